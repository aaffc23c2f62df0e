/* xgrammar's matcher methods through tvm-ffi's C ABI (the layouts of tvm/ffi/c_api.h and
   dlpack.h, both stable ABIs), bound at run time from Python, never linked. The calls below
   need no GIL; the matcher they are given must be owned by the caller for the whole call. */

typedef struct {
    int32_t type_index;
    uint32_t zero_padding;
    union {
        int64_t v_int64;
        double v_float64;
        void *v_ptr;
    };
} FfiAny;

typedef struct {
    uint64_t ref_count;
    int32_t type_index;
    uint32_t padding;
    void *deleter;
} FfiObject;

typedef struct {
    const char *data;
    size_t size;
} FfiBytes;

typedef struct {
    FfiBytes kind, message;
} FfiErrorCell; /* follows the object header; only its first fields are read */

typedef struct {
    int32_t device_type, device_id;
} DlDevice;

typedef struct {
    uint8_t code, bits;
    uint16_t lanes;
} DlDataType;

typedef struct {
    void *data;
    DlDevice device;
    int32_t ndim;
    DlDataType dtype;
    int64_t *shape, *strides;
    uint64_t byte_offset;
} DlTensor;

enum { FFI_NONE = 0, FFI_INT = 1, FFI_BOOL = 2, FFI_FLOAT = 3, FFI_DLTENSOR_PTR = 7, FFI_STATIC_OBJECT = 64 };

typedef int (*ffi_call_fn)(void *func, FfiAny *args, int32_t num_args, FfiAny *result);
typedef void (*ffi_move_error_fn)(void **error);
typedef int (*ffi_decref_fn)(void *object);

static ffi_call_fn ffi_call;
static ffi_move_error_fn ffi_move_error;
static ffi_decref_fn ffi_decref;
static void *xgr_traverse_fn, *xgr_is_terminated_fn;
/* the single-step methods (xgrammar_grow's moves): bound separately, NULL until then */
static void *xgr_accept_fn, *xgr_fill_fn, *xgr_rollback_fn;
static int32_t xgr_matcher_type = -1;

static PyObject *xgrammar_bind(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long call, move_error, decref, traverse, is_terminated;
    int type_index;
    if (!PyArg_ParseTuple(args, "KKKKKi", &call, &move_error, &decref, &traverse, &is_terminated,
                          &type_index))
        return NULL;
    if (!call || !move_error || !decref || !traverse || !is_terminated ||
        type_index < FFI_STATIC_OBJECT) {
        PyErr_SetString(PyExc_ValueError, "xgrammar_bind: a null address or a bad type index");
        return NULL;
    }
    ffi_call = (ffi_call_fn)(uintptr_t)call;
    ffi_move_error = (ffi_move_error_fn)(uintptr_t)move_error;
    ffi_decref = (ffi_decref_fn)(uintptr_t)decref;
    xgr_traverse_fn = (void *)(uintptr_t)traverse;
    xgr_is_terminated_fn = (void *)(uintptr_t)is_terminated;
    xgr_matcher_type = type_index;
    Py_RETURN_NONE;
}

/* The matcher type's accept_token, fill_next_token_bitmask and rollback functions (the same
   type xgrammar_bind bound). */
static PyObject *xgrammar_bind_moves(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long accept, fill, rollback;
    if (!PyArg_ParseTuple(args, "KKK", &accept, &fill, &rollback)) return NULL;
    if (ffi_call == NULL || !accept || !fill || !rollback) {
        PyErr_SetString(PyExc_ValueError,
                        "xgrammar_bind_moves: a null address, or xgrammar_bind not called");
        return NULL;
    }
    xgr_accept_fn = (void *)(uintptr_t)accept;
    xgr_fill_fn = (void *)(uintptr_t)fill;
    xgr_rollback_fn = (void *)(uintptr_t)rollback;
    Py_RETURN_NONE;
}

/* Whether the single-step methods are bound. */
static int ffi_moves_bound(void) {
    return ffi_call != NULL && xgr_accept_fn != NULL && xgr_fill_fn != NULL &&
           xgr_rollback_fn != NULL;
}

/* 0 when xgrammar's methods are bound, else -1 with a RuntimeError. */
static int ffi_bound(void) {
    if (ffi_call != NULL) return 0;
    PyErr_SetString(PyExc_RuntimeError, "xgrammar's methods are not bound (xgrammar_bind)");
    return -1;
}

/* The tvm-ffi argument of the matcher object at `handle` (an address the library took from a
   live matcher it holds): 0, or -1 with a Python error when nothing is bound or the object is
   not a matcher of the bound type. */
static int ffi_matcher(uintptr_t handle, FfiAny *arg) {
    if (ffi_bound() != 0) return -1;
    FfiObject *object = (FfiObject *)handle;
    if (object == NULL || object->type_index != xgr_matcher_type) {
        PyErr_SetString(PyExc_TypeError, "not the handle of an xgrammar GrammarMatcher");
        return -1;
    }
    arg->type_index = object->type_index;
    arg->zero_padding = 0;
    arg->v_ptr = object;
    return 0;
}

/* The error tvm-ffi raised, as a malloc'd "Kind: message" string (NULL if out of memory). */
static char *ffi_take_error(void) {
    void *error = NULL;
    ffi_move_error(&error);
    const char *kind = "Error", *text = "xgrammar failed";
    size_t nkind = strlen(kind), ntext = strlen(text);
    if (error != NULL) {
        const FfiErrorCell *cell = (const FfiErrorCell *)((const char *)error + sizeof(FfiObject));
        if (cell->kind.data != NULL) kind = cell->kind.data, nkind = cell->kind.size;
        if (cell->message.data != NULL) text = cell->message.data, ntext = cell->message.size;
    }
    char *out = malloc(nkind + ntext + 3);
    if (out != NULL) {
        memcpy(out, kind, nkind);
        memcpy(out + nkind, ": ", 2);
        memcpy(out + nkind + 2, text, ntext);
        out[nkind + 2 + ntext] = 0;
    }
    if (error != NULL) ffi_decref(error);
    return out;
}

static void ffi_tensor(DlTensor *t, void *data, int ndim, int64_t *shape, uint8_t bits) {
    t->data = data;
    t->device.device_type = 1; /* kDLCPU */
    t->device.device_id = 0;
    t->ndim = ndim;
    t->dtype.code = 0; /* kDLInt */
    t->dtype.bits = bits;
    t->dtype.lanes = 1;
    t->shape = shape;
    t->strides = NULL;
    t->byte_offset = 0;
}

static void ffi_arg(FfiAny *arg, int32_t type_index) {
    arg->type_index = type_index;
    arg->zero_padding = 0;
    arg->v_int64 = 0;
}

/* A matcher method taking nothing and returning a bool (`fn`, bound): 0 or 1, or -1 with
   *error set (malloc'd or NULL). */
static int ffi_bool_query(void *fn, const FfiAny *matcher, char **error) {
    FfiAny args[1] = {*matcher}, result;
    ffi_arg(&result, FFI_NONE);
    if (ffi_call(fn, args, 1, &result) != 0) {
        *error = ffi_take_error();
        return -1;
    }
    return result.v_int64 != 0;
}

/* matcher.is_terminated(): 0 or 1, or -1 with *error set (malloc'd or NULL). */
static int ffi_is_terminated(const FfiAny *matcher, char **error) {
    return ffi_bool_query(xgr_is_terminated_fn, matcher, error);
}

/* matcher.traverse_draft_tree over n nodes (links and tokens int64 [n], rows int32
   [n, words]): 0, or -1 with *error set (malloc'd or NULL). */
static int ffi_traverse(const FfiAny *matcher, int64_t *nt, int64_t *ns, int64_t *tokens,
                        int32_t *rows, int64_t n, int64_t words, char **error) {
    FfiAny args[7], result;
    args[0] = *matcher;
    int64_t shape1[1] = {n}, shape2[2] = {n, words};
    DlTensor t_nt, t_ns, t_tokens, t_rows;
    ffi_tensor(&t_nt, nt, 1, shape1, 64);
    ffi_tensor(&t_ns, ns, 1, shape1, 64);
    ffi_tensor(&t_tokens, tokens, 1, shape1, 64);
    ffi_tensor(&t_rows, rows, 2, shape2, 32);
    DlTensor *tensors[4] = {&t_nt, &t_ns, &t_tokens, &t_rows};
    for (int i = 0; i < 4; i++) {
        ffi_arg(&args[1 + i], FFI_DLTENSOR_PTR);
        args[1 + i].v_ptr = tensors[i];
    }
    ffi_arg(&args[5], FFI_FLOAT);
    args[5].v_float64 = -1.0; /* no time limit */
    ffi_arg(&args[6], FFI_NONE); /* no temperatures */
    ffi_arg(&result, FFI_NONE);
    if (ffi_call(xgr_traverse_fn, args, 7, &result) != 0) {
        *error = ffi_take_error();
        return -1;
    }
    return 0;
}

/* matcher.accept_token(token, debug_print=False): 1 accepted, 0 refused, or -1 with *error
   set (malloc'd or NULL). */
static int ffi_accept(const FfiAny *matcher, int64_t token, char **error) {
    FfiAny args[3] = {*matcher}, result;
    ffi_arg(&args[1], FFI_INT);
    args[1].v_int64 = token;
    ffi_arg(&args[2], FFI_BOOL);
    ffi_arg(&result, FFI_NONE);
    if (ffi_call(xgr_accept_fn, args, 3, &result) != 0) {
        *error = ffi_take_error();
        return -1;
    }
    return result.v_int64 != 0;
}

/* matcher.fill_next_token_bitmask(row, 0) into one int32 row of `words` words: 0, or -1 with
   *error set. */
static int ffi_fill(const FfiAny *matcher, int32_t *row, int64_t words, char **error) {
    FfiAny args[4] = {*matcher}, result;
    int64_t shape[2] = {1, words};
    DlTensor t_row;
    ffi_tensor(&t_row, row, 2, shape, 32);
    ffi_arg(&args[1], FFI_DLTENSOR_PTR);
    args[1].v_ptr = &t_row;
    ffi_arg(&args[2], FFI_INT);
    ffi_arg(&args[3], FFI_BOOL);
    ffi_arg(&result, FFI_NONE);
    if (ffi_call(xgr_fill_fn, args, 4, &result) != 0) {
        *error = ffi_take_error();
        return -1;
    }
    return 0;
}

/* matcher.rollback(count): 0, or -1 with *error set. */
static int ffi_rollback(const FfiAny *matcher, int64_t count, char **error) {
    FfiAny args[2] = {*matcher}, result;
    ffi_arg(&args[1], FFI_INT);
    args[1].v_int64 = count;
    ffi_arg(&result, FFI_NONE);
    if (ffi_call(xgr_rollback_fn, args, 2, &result) != 0) {
        *error = ffi_take_error();
        return -1;
    }
    return 0;
}
