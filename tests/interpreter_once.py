"""Triton's interpreter, patching triton.language once per launch.

Imported first by the interpreter tests' subprocesses (tests/test_kernels.py `_interpret`). The
interpreter (Triton 3.9) re-patches `triton.language` at every call of a `@triton.jit` helper inside a
kernel, walking the modules with `inspect.getmembers` each time: 14k calls and ~29% of the depth-frame
test's 50 s per frame. A launch patches the same modules first and restores them when it ends, so a
helper's call that sees no other module patches nothing new; this skips it. A Triton without these
internals runs as it is.
"""
import inspect

import triton.language as tl

try:
    from triton.runtime import interpreter
    _patch_lang, _launch, _empty_scope = interpreter._patch_lang, interpreter.GridExecutor.__call__, \
        interpreter._LangPatchScope
except (ImportError, AttributeError):
    interpreter = None

_patched: set = set()    # the language modules the running launch has patched


def _langs(fn) -> set:
    return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}


def _patch_lang_once(fn):
    langs = _langs(fn)
    if langs and langs <= _patched:
        return _empty_scope()
    scope = _patch_lang(fn)
    _patched.update(langs)
    return scope


def _launch_patching_once(self, *args, **kwargs):
    _patched.clear()
    try:
        return _launch(self, *args, **kwargs)
    finally:
        _patched.clear()


if interpreter is not None:
    interpreter._patch_lang = _patch_lang_once
    interpreter.GridExecutor.__call__ = _launch_patching_once
