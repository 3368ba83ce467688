/* A captured graph's launch in one C call: the driver's cuGraphLaunch on an exec handle and a
   stream, both given as addresses (design note "compiled launch" in runtime/raw_launch.py).

   libcuda is opened on the first call (dlopen, as the CUDA runtime itself opens it), so the
   module imports on a machine without a GPU driver; there every launch answers NO_DRIVER and
   the caller keeps cuda-python's launch. A cudaGraphExec_t is a CUgraphExec and a cudaStream_t
   a CUstream: the runtime's handles are the driver's. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>

#define NO_DRIVER (-1) /* not a CUresult: libcuda or its cuGraphLaunch could not be loaded */

typedef int (*graph_launch_fn)(void *exec, void *stream);
typedef int (*error_name_fn)(int error, const char **name);

static graph_launch_fn graph_launch_entry;
static error_name_fn error_name_entry;
static int is_looked_up;

static void look_up(void)
{
    void *lib;
    is_looked_up = 1;
    lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL)
        return;
    graph_launch_entry = (graph_launch_fn)dlsym(lib, "cuGraphLaunch");
    error_name_entry = (error_name_fn)dlsym(lib, "cuGetErrorName");
}

/* launch(exec, stream) -> the CUresult (0: launched), or NO_DRIVER. */
static PyObject *launch(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    void *exec, *stream;
    (void)module;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "launch takes 2 arguments (exec, stream), got %zd", nargs);
        return NULL;
    }
    exec = PyLong_AsVoidPtr(args[0]);
    if (exec == NULL && PyErr_Occurred())
        return NULL;
    stream = PyLong_AsVoidPtr(args[1]); /* 0: the legacy default stream, as cudaGraphLaunch takes it */
    if (stream == NULL && PyErr_Occurred())
        return NULL;
    if (exec == NULL) {
        PyErr_SetString(PyExc_ValueError, "launch: a null exec handle");
        return NULL;
    }
    if (!is_looked_up)
        look_up();
    if (graph_launch_entry == NULL)
        return PyLong_FromLong(NO_DRIVER);
    return PyLong_FromLong(graph_launch_entry(exec, stream));
}

/* error_name(code) -> the driver's name for a CUresult ("CUDA_ERROR_..."), or None. */
static PyObject *error_name(PyObject *module, PyObject *arg)
{
    const char *name = NULL;
    long code = PyLong_AsLong(arg);
    (void)module;
    if (code == -1 && PyErr_Occurred())
        return NULL;
    if (!is_looked_up)
        look_up();
    if (error_name_entry == NULL || error_name_entry((int)code, &name) != 0 || name == NULL)
        Py_RETURN_NONE;
    return PyUnicode_FromString(name);
}

/* is_available() -> whether libcuda's cuGraphLaunch was found. */
static PyObject *is_available(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    if (!is_looked_up)
        look_up();
    return PyBool_FromLong(graph_launch_entry != NULL);
}

static PyMethodDef methods[] = {
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
     "cuGraphLaunch(exec, stream): the CUresult, or -1 without libcuda."},
    {"error_name", error_name, METH_O, "The driver's name of a CUresult, or None."},
    {"is_available", is_available, METH_NOARGS, "Whether libcuda's cuGraphLaunch was found."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "graph_launch_native", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_graph_launch_native(void) { return PyModule_Create(&module_def); }
