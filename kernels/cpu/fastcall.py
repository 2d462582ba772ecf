"""Calls into the C kernels without ctypes' per-argument cost: a small CPython extension, generated from the
entry points' ctypes signatures, that converts each argument once (PyLong_AsLongLong and friends) and calls
the same function pointer with the GIL released, as ctypes does.

Why: ctypes converts every argument through its argtypes at about 0.27 us apiece on a 2-core AMD EPYC Zen 3
VM (a 14-argument call 4.0 us, a call without arguments 0.3), and one decode step of the int4 SmolLM2 makes
~300 kernel calls of 6-29 arguments. The wrappers take what the ctypes functions took, positionally, with
pointers as Python ints (``tensor.data_ptr()``) or None for NULL; anything else raises TypeError.

Built with the kernels' compiler and Python's own headers beside the kernel library (its build key covers the
generated source and the interpreter's ABI), loaded once per process. Without Python's headers, or where the
build fails, or with ``PREFIXSERVE_FASTCALL=0``, :func:`fast_calls` returns {} and callers keep ctypes.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_SWITCH = "PREFIXSERVE_FASTCALL"
MODULE = "_ps_fastcall"

# ctypes type -> (C declaration, conversion of PyObject *o)
_CONVERT = {
    ctypes.c_void_p: ("void *", "ps_ptr({o})"),
    ctypes.c_int64: ("int64_t", "PyLong_AsLongLong({o})"),
    ctypes.c_int: ("int", "(int)PyLong_AsLong({o})"),
    ctypes.c_float: ("float", "(float)PyFloat_AsDouble({o})"),
}

_PRELUDE = """#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* an int (tensor.data_ptr()) or None for NULL */
static inline void *ps_ptr(PyObject *o) { return o == Py_None ? NULL : PyLong_AsVoidPtr(o); }
"""


def _wrapper(i: int, name: str, argtypes: list, restype) -> str:
    decls = [_CONVERT[t][0] for t in argtypes]
    ret = "int64_t" if restype is ctypes.c_int64 else "void"
    lines = [f"typedef {ret} (*ps_fn{i}_t)({', '.join(decls) or 'void'});",
             f"static ps_fn{i}_t ps_fn{i};",
             f"static PyObject *ps_w{i}(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {{",
             f"    (void)self;",
             f"    if (nargs != {len(argtypes)}) {{",
             f'        PyErr_Format(PyExc_TypeError, "{name}() takes {len(argtypes)} arguments (%zd given)", nargs);',
             f"        return NULL;",
             f"    }}"]
    lines += [f"    {decl} a{j} = {_CONVERT[t][1].format(o=f'args[{j}]')};"
              for j, (t, decl) in enumerate(zip(argtypes, decls))]
    call = f"ps_fn{i}({', '.join(f'a{j}' for j in range(len(argtypes)))})"
    lines += ["    if (PyErr_Occurred()) return NULL;"]
    if ret == "void":
        lines += ["    Py_BEGIN_ALLOW_THREADS", f"    {call};", "    Py_END_ALLOW_THREADS", "    Py_RETURN_NONE;", "}"]
    else:
        lines += ["    int64_t r;", "    Py_BEGIN_ALLOW_THREADS", f"    r = {call};", "    Py_END_ALLOW_THREADS",
                  "    return PyLong_FromLongLong(r);", "}"]
    return "\n".join(lines)


def source(signatures: dict[str, tuple[list, object]]) -> str:
    """The extension's C source for ``signatures`` (symbol -> (argtypes, restype)): one wrapper per symbol,
    named as the symbol, and ``_bind(addresses)`` that sets their function pointers in the same order."""
    names = sorted(signatures)
    parts = [_PRELUDE] + [_wrapper(i, n, *signatures[n]) for i, n in enumerate(names)]
    binds = "\n".join(f"    ps_fn{i} = (ps_fn{i}_t)PyLong_AsVoidPtr(PyTuple_GET_ITEM(t, {i}));"
                      for i in range(len(names)))
    parts.append(f"""static PyObject *ps_bind(PyObject *self, PyObject *t) {{
    (void)self;
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != {len(names)}) {{
        PyErr_SetString(PyExc_TypeError, "_bind takes a tuple of {len(names)} addresses");
        return NULL;
    }}
{binds}
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}}""")
    methods = ",\n".join(f'    {{"{n}", (PyCFunction)(void (*)(void))ps_w{i}, METH_FASTCALL, NULL}}'
                         for i, n in enumerate(names))
    parts.append(f"""static PyMethodDef ps_methods[] = {{
    {{"_bind", ps_bind, METH_O, NULL}},
{methods},
    {{NULL, NULL, 0, NULL}}
}};
static struct PyModuleDef ps_module = {{PyModuleDef_HEAD_INIT, "{MODULE}", NULL, -1, ps_methods}};
PyMODINIT_FUNC PyInit_{MODULE}(void) {{ return PyModule_Create(&ps_module); }}
""")
    return "\n\n".join(parts)


def _build(cc: str, src: str, cache_dir: Path) -> Path:
    key = hashlib.sha256("\0".join([src, cc, sys.implementation.cache_tag, sysconfig.get_config_var("EXT_SUFFIX")
                                    or ""]).encode()).hexdigest()[:16]
    target = cache_dir / f"{MODULE}-{key}{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:  # compile privately, then rename into place
        c_file, so_file = Path(tmp) / f"{MODULE}.c", Path(tmp) / f"{MODULE}.so"
        c_file.write_text(src)
        subprocess.run([cc, "-O2", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", str(c_file), "-o",
                        str(so_file)], check=True, capture_output=True, text=True)
        os.replace(so_file, target)
    return target


def fast_calls(functions: dict[str, ctypes._CFuncPtr], cc: str, cache_dir: Path) -> dict[str, object]:
    """Symbol -> a fast callable for each ctypes function in ``functions`` (their argtypes and restype set);
    {} where the extension cannot be had (see module doc)."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no") or not functions:
        return {}
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        logger.info("no Python headers: the C kernels are called through ctypes")
        return {}
    try:
        signatures = {n: (list(f.argtypes), f.restype) for n, f in functions.items()}
        path = _build(cc, source(signatures), cache_dir)
        spec = importlib.util.spec_from_file_location(MODULE, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module._bind(tuple(ctypes.cast(functions[n], ctypes.c_void_p).value for n in sorted(functions)))
    except (OSError, ImportError, KeyError, subprocess.CalledProcessError) as exc:
        logger.warning("the C kernels' fast calls failed to build, using ctypes: %s",
                       getattr(exc, "stderr", "") or exc)
        return {}
    return {n: getattr(module, n) for n in functions}
