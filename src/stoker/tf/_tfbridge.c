/* stoker's TensorFlow bridge: one op, StokerNextBatch, that hands a loader's batch to
 * tf.data without Python in TensorFlow's per-element path.
 *
 * tf.numpy_function's py_func machinery (function registry lookup, argument and result
 * conversion) cost more CPU per batch than this op (measured:
 * benchmarks/results/tf_compare_history.md). This op takes the GIL once, calls
 * stoker.tf.passes.native_next(key), and wraps each returned array's memory as a tensor
 * with TF_NewTensor: no copy, and the array is kept alive (a buffer view holds it)
 * until TensorFlow drops the tensor. stoker never rewrites a buffer while an array
 * on it is alive, so a tensor never changes under its holder.
 *
 * Built at first use by stoker.tf.op (see _build_bridge) against the installed
 * TensorFlow's C API headers, which are ABI stable; loaded with tf.load_op_library.
 * Where it cannot be built, stoker.tf falls back to tf.numpy_function.
 *
 * Op: StokerNextBatch(key: int64) -> values: Tout
 *   native_next(key) returns a sequence of C-contiguous arrays, one per Tout entry, or
 *   None at the end of the pass: the op then fails with OutOfRange, which ends the
 *   map stage stoker.tf runs it in (preserve_cardinality=False). A Python exception
 *   becomes the op's error, with the exception's type and message.
 *   With an empty Tout the call is a pass's close (key -k closes pass k, run when
 *   TensorFlow destroys its iterator): where Python has exited already there is nothing
 *   left to close, so it succeeds quietly instead of making TensorFlow log an error.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tensorflow/c/kernels.h"
/* ops.h declares these structs for C++ only (no typedefs): name them for C. */
typedef struct TF_DimensionHandle TF_DimensionHandle;
typedef struct TF_OpDefinitionBuilder TF_OpDefinitionBuilder;
typedef struct TF_ShapeHandle TF_ShapeHandle;
typedef struct TF_ShapeInferenceContext TF_ShapeInferenceContext;
#include "tensorflow/c/ops.h"
#include "tensorflow/c/tf_datatype.h"
#include "tensorflow/c/tf_status.h"
#include "tensorflow/c/tf_tensor.h"

#define OP_NAME "StokerNextBatch"
#define MAX_DIMS 32

typedef struct {
    int n;              /* values per batch */
    TF_DataType *types; /* their dtypes, from the Tout attr */
} Kernel;

static PyObject *next_fn; /* stoker.tf.passes.native_next, looked up once under the GIL */

/* The GIL, for a thread TensorFlow started as well as a Python one. A thread without a
 * Python thread state gets one at its first call and keeps it (one extra Ensure that is
 * never released): TensorFlow's pool threads call in for every batch, and creating and
 * deleting a thread state each time costs more than the rest of the call. */
static PyGILState_STATE take_gil(void) {
    int foreign = PyGILState_GetThisThreadState() == NULL;
    PyGILState_STATE gil = PyGILState_Ensure();
    if (foreign)
        (void)PyGILState_Ensure(); /* kept: the matching Release never comes */
    return gil;
}

static int finalizing(void) {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}

/* Views of tensors TensorFlow dropped on a thread without the GIL, released at the op's
 * next call (which holds it) or by stoker_tfbridge_drain(). Taking the GIL in the
 * deallocator meant two more GIL round trips per batch (one per field) on TensorFlow's
 * threads in a graph consumer, each waiting out a worker's Python. A view waits at most
 * until the next batch of any to_tf pass, or the end of its own pass. */
static pthread_mutex_t pending_lock = PTHREAD_MUTEX_INITIALIZER;
static Py_buffer **pending;
static size_t pending_n, pending_cap;

/* Release the views dropped so far (caller holds the GIL). */
static void drain_views(void) {
    pthread_mutex_lock(&pending_lock);
    Py_buffer **views = pending;
    size_t n = pending_n;
    pending = NULL, pending_n = pending_cap = 0;
    pthread_mutex_unlock(&pending_lock);
    for (size_t i = 0; i < n; i++) {
        PyBuffer_Release(views[i]);
        free(views[i]);
    }
    free(views);
}

/* For stoker.tf.op.drain (through ctypes.PyDLL, which keeps the GIL): release what waits now. */
__attribute__((visibility("default"))) void stoker_tfbridge_drain(void) { drain_views(); }

/* Queue a view for drain_views; 0, or -1 where no memory could be had. */
static int defer_view(Py_buffer *view) {
    int rc = 0;
    pthread_mutex_lock(&pending_lock);
    if (pending_n == pending_cap) {
        size_t cap = pending_cap ? 2 * pending_cap : 16;
        Py_buffer **grown = realloc(pending, cap * sizeof *grown);
        if (grown)
            pending = grown, pending_cap = cap;
        else
            rc = -1;
    }
    if (rc == 0)
        pending[pending_n++] = view;
    pthread_mutex_unlock(&pending_lock);
    return rc;
}

/* TensorFlow dropped a tensor that aliased a numpy array: release the view (and with it
 * the array), now where this thread holds the GIL (an eager consumer's), else at the op's
 * next call (see pending). At interpreter shutdown the view is leaked rather than touched. */
static void release_view(void *data, size_t len, void *arg) {
    (void)data;
    (void)len;
    Py_buffer *view = (Py_buffer *)arg;
    if (!Py_IsInitialized() || finalizing()) {
        free(view);
        return;
    }
    if (!PyGILState_Check() && defer_view(view) == 0)
        return;
    PyGILState_STATE gil = take_gil();
    PyBuffer_Release(view);
    PyGILState_Release(gil);
    free(view);
}

static void fail(TF_OpKernelContext *ctx, TF_Code code, const char *message) {
    TF_Status *status = TF_NewStatus();
    TF_SetStatus(status, code, message);
    TF_OpKernelContext_Failure(ctx, status);
    TF_DeleteStatus(status);
}

/* The pending Python exception as the op's error: "TypeName: message", with the
 * code TensorFlow's own py_func gives that exception type. Clears the exception. */
static void fail_from_python(TF_OpKernelContext *ctx) {
    TF_Code code = TF_UNKNOWN;
    if (PyErr_ExceptionMatches(PyExc_ValueError) || PyErr_ExceptionMatches(PyExc_TypeError))
        code = TF_INVALID_ARGUMENT;
    else if (PyErr_ExceptionMatches(PyExc_MemoryError))
        code = TF_RESOURCE_EXHAUSTED;
    else if (PyErr_ExceptionMatches(PyExc_NotImplementedError))
        code = TF_UNIMPLEMENTED;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject *text = value ? PyObject_Str(value) : NULL;
    const char *name = type ? ((PyTypeObject *)type)->tp_name : "error";
    const char *dot = strrchr(name, '.');
    const char *msg = text ? PyUnicode_AsUTF8(text) : NULL;
    PyErr_Clear();
    size_t size = strlen(name) + (msg ? strlen(msg) : 0) + 8;
    char *buffer = malloc(size);
    if (buffer) {
        snprintf(buffer, size, "%s: %s", dot ? dot + 1 : name, msg ? msg : "");
        fail(ctx, code, buffer);
        free(buffer);
    } else {
        fail(ctx, code, name);
    }
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

static void *create(TF_OpKernelConstruction *ctx) {
    TF_Status *status = TF_NewStatus();
    int32_t count = 0, total = 0;
    TF_OpKernelConstruction_GetAttrSize(ctx, "Tout", &count, &total, status);
    Kernel *k = calloc(1, sizeof(Kernel));
    if (k && TF_GetCode(status) == TF_OK) {
        k->n = count;
        k->types = calloc(count ? (size_t)count : 1, sizeof(TF_DataType));
        if (k->types && count)
            TF_OpKernelConstruction_GetAttrTypeList(ctx, "Tout", k->types, count, status);
    }
    if (!k || !k->types || TF_GetCode(status) != TF_OK) {
        if (TF_GetCode(status) == TF_OK)
            TF_SetStatus(status, TF_RESOURCE_EXHAUSTED, OP_NAME ": out of memory");
        TF_OpKernelConstruction_Failure(ctx, status);
    }
    TF_DeleteStatus(status);
    return k;
}

static void destroy(void *kernel) {
    Kernel *k = kernel;
    if (k) {
        free(k->types);
        free(k);
    }
}

/* Wrap arrays[i] as output i + 1. Returns 0 on success, else has failed the op. */
static int set_value(Kernel *k, TF_OpKernelContext *ctx, int i, PyObject *array, TF_Status *status) {
    Py_buffer *view = malloc(sizeof(Py_buffer));
    if (!view) {
        fail(ctx, TF_RESOURCE_EXHAUSTED, OP_NAME ": out of memory");
        return -1;
    }
    if (PyObject_GetBuffer(array, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
        free(view);
        fail_from_python(ctx);
        return -1;
    }
    size_t itemsize = TF_DataTypeSize(k->types[i]);
    if (view->ndim > MAX_DIMS || (size_t)view->itemsize != itemsize) {
        char message[200];
        snprintf(message, sizeof message, OP_NAME ": value %d has %zd-byte items in %d dimensions, expected %zu-byte items",
                 i, view->itemsize, view->ndim, itemsize);
        PyBuffer_Release(view);
        free(view);
        fail(ctx, TF_INTERNAL, message);
        return -1;
    }
    int64_t dims[MAX_DIMS];
    for (int d = 0; d < view->ndim; d++)
        dims[d] = view->shape[d];
    /* TF_NewTensor aliases 64-byte aligned memory (stoker's buffers are page aligned)
     * and copies anything less aligned, releasing the view at once. */
    TF_Tensor *t = TF_NewTensor(k->types[i], dims, view->ndim, view->buf, (size_t)view->len, release_view, view);
    if (!t) {
        fail(ctx, TF_INTERNAL, OP_NAME ": TF_NewTensor refused a batch array");
        return -1;
    }
    TF_SetOutput(ctx, i, t, status);
    TF_DeleteTensor(t);
    if (TF_GetCode(status) != TF_OK) {
        TF_OpKernelContext_Failure(ctx, status);
        return -1;
    }
    return 0;
}

static void compute(void *kernel, TF_OpKernelContext *ctx) {
    Kernel *k = kernel;
    TF_Status *status = TF_NewStatus();
    TF_Tensor *key_tensor = NULL;
    TF_GetInput(ctx, 0, &key_tensor, status);
    if (TF_GetCode(status) != TF_OK) {
        TF_OpKernelContext_Failure(ctx, status);
        TF_DeleteStatus(status);
        return;
    }
    int64_t key = *(int64_t *)TF_TensorData(key_tensor);
    TF_DeleteTensor(key_tensor);
    if (!Py_IsInitialized() || finalizing()) { /* TensorFlow still running as Python exits */
        if (k->n > 0) /* a close (no outputs) has nothing left to do */
            fail(ctx, TF_CANCELLED, OP_NAME ": the Python interpreter is shutting down");
        TF_DeleteStatus(status);
        return;
    }

    PyGILState_STATE gil = take_gil();
    drain_views();
    PyObject *result = NULL, *items = NULL;
    if (!next_fn) {
        PyObject *module = PyImport_ImportModule("stoker.tf.passes");
        if (module) {
            next_fn = PyObject_GetAttrString(module, "native_next");
            Py_DECREF(module);
        }
    }
    if (next_fn)
        result = PyObject_CallFunction(next_fn, "L", (long long)key);
    if (!result) {
        fail_from_python(ctx);
        goto done;
    }
    if (result == Py_None) {
        fail(ctx, TF_OUT_OF_RANGE, "end of the pass");
        goto done;
    }
    items = PySequence_Fast(result, "native_next must return a sequence of arrays or None");
    if (!items) {
        fail_from_python(ctx);
        goto done;
    }
    if (PySequence_Fast_GET_SIZE(items) != k->n) {
        char message[160];
        snprintf(message, sizeof message, OP_NAME ": got %zd arrays, Tout has %d", PySequence_Fast_GET_SIZE(items), k->n);
        fail(ctx, TF_INTERNAL, message);
        goto done;
    }
    for (int i = 0; i < k->n; i++)
        if (set_value(k, ctx, i, PySequence_Fast_GET_ITEM(items, i), status) != 0)
            break;
done:
    Py_XDECREF(items);
    Py_XDECREF(result);
    PyGILState_Release(gil);
    TF_DeleteStatus(status);
}

static void register_bridge(void) __attribute__((constructor));

static void register_bridge(void) {
    TF_Status *status = TF_NewStatus();
    TF_OpDefinitionBuilder *op = TF_NewOpDefinitionBuilder(OP_NAME);
    TF_OpDefinitionBuilderAddInput(op, "key: int64");
    TF_OpDefinitionBuilderAddOutput(op, "values: Tout");
    TF_OpDefinitionBuilderAddAttr(op, "Tout: list(type) >= 0");
    TF_OpDefinitionBuilderSetIsStateful(op, 1);
    TF_OpDefinitionBuilderSetShapeInferenceFunction(op, TF_ShapeInferenceContextSetUnknownShape);
    TF_RegisterOpDefinition(op, status);
    if (TF_GetCode(status) == TF_OK) {
        TF_KernelBuilder *builder = TF_NewKernelBuilder(OP_NAME, "CPU", create, compute, destroy);
        TF_RegisterKernelBuilder(OP_NAME "Kernel", builder, status);
    }
    TF_DeleteStatus(status);
}
