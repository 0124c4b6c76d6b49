# esb_vars: a bounded summary of a Python namespace's variables, for time travel (issue 13).
# Guest-side code, stdlib only, no third-party import (numpy, pandas, torch are recognised by
# duck typing on the attributes of objects whose class comes from them). Shared by the heavy
# kernel (src/agent/python/kernel.py, loaded from the same directory) and the nano tier.
#
#   summarize(ns)                 -> JSON text: [{"name","type","repr",...}, ...]
#   summarize_traceback(tb, skip) -> JSON text: [{"function","file","line","variables":[...]}]
#
# Guarantees (each summary): at most MAX_JSON_BYTES of UTF-8 JSON; at most MAX_NAMES names
# (sorted; names starting with "_" and modules are left out); every "repr" at most REPR_MAX
# characters. repr() is never called on an object whose class is not a builtin one (a user
# __repr__ could be slow, have side effects or raise): builtin values get a bounded repr built
# here (depth, items and string lengths cut), everything else "<module.Class object>".
# Attributes (shape, dtype, nbytes, columns) are read only from objects of known array and
# frame libraries (TRUSTED_MODULES); a user class with a `shape` property is never touched.
# Optional fields, where known: "len" (builtin containers, str, bytes), "shape" (list of
# ints), "dtype" (str), "nbytes" (int), "columns" (list of str, at most MAX_COLUMNS),
# "dtypes" (list of str, per column), "truncated" (true when the repr was cut).
# When the byte budget or the time budget runs out, a last entry {"name": "...", "type":
# "truncated", "repr": "N more variables not shown", "omitted": N} says how many are missing.
import json
import time
import types

MAX_JSON_BYTES = 64 * 1024
MAX_NAMES = 500
REPR_MAX = 256
STR_MAX = 120          # characters of a string value shown inside a repr
ITEMS_MAX = 8          # elements of a container shown
DEPTH_MAX = 3          # nesting shown
MAX_COLUMNS = 50
HEAD_ROWS = 3
TIME_BUDGET_S = 0.05   # after this, remaining names get type only (no repr)
MAX_FRAMES = 16

TRUSTED_MODULES = ("numpy", "pandas", "torch", "polars", "xarray", "scipy", "jax", "jaxlib",
                   "pyarrow", "tensorflow", "cupy", "dask")

_SCALARS = (int, float, complex, bool, type(None))
_type_qualname = type.__dict__["__qualname__"].__get__
_type_module = type.__dict__["__module__"].__get__


def type_name(t):
    """'module.Qualname' of class t, read through type's own descriptors (a metaclass cannot
    fake them), 'Qualname' for builtins."""
    try:
        name = _type_qualname(t)
        module = _type_module(t)
    except Exception:
        return "?"
    if type(name) is not str:
        name = "?"
    if type(module) is not str:
        module = "?"
    full = name if module == "builtins" else module + "." + name
    return full[:REPR_MAX]


def _trusted(t):
    try:
        module = _type_module(t)
    except Exception:
        return False
    return type(module) is str and module.split(".", 1)[0] in TRUSTED_MODULES


class _Budget:
    def __init__(self, limit):
        self.left = limit

    def take(self, n):
        self.left -= n
        return self.left >= 0


def _short_str(s):
    return s if len(s) <= STR_MAX else s[:STR_MAX]


def safe_repr(v, depth=0):
    """A bounded repr of v built without calling any user code: exact builtin types only
    (subclasses of builtins are shown by type name, since they may override __repr__)."""
    t = type(v)
    if t in _SCALARS:
        if t is int and v.bit_length() > 200:
            return "<int of %d bits>" % v.bit_length()
        return repr(v)
    if t is str:
        r = repr(_short_str(v))
        return r if len(v) <= STR_MAX else r + "..."
    if t in (bytes, bytearray):
        r = repr(t(v[:STR_MAX]))
        return r if len(v) <= STR_MAX else r + "..."
    if t in (list, tuple, set, frozenset, dict):
        if depth >= DEPTH_MAX:
            return {list: "[...]", tuple: "(...)", dict: "{...}"}.get(t, t.__name__ + "(...)")
        parts = []
        if t is dict:
            for i, (k, x) in enumerate(dict.items(v)):
                if i >= ITEMS_MAX:
                    parts.append("...")
                    break
                parts.append(safe_repr(k, depth + 1) + ": " + safe_repr(x, depth + 1))
            return "{" + ", ".join(parts) + "}"
        items = list.__iter__(v) if t is list else iter(v)  # builtin iterators only
        for i, x in enumerate(items):
            if i >= ITEMS_MAX:
                parts.append("...")
                break
            parts.append(safe_repr(x, depth + 1))
        body = ", ".join(parts)
        if t is list:
            return "[" + body + "]"
        if t is tuple:
            return "(" + body + ("," if len(parts) == 1 else "") + ")"
        if not parts:
            return t.__name__ + "()"
        return ("{" + body + "}") if t is set else "frozenset({" + body + "})"
    if t is range:
        return repr(v)
    if _trusted(t):
        return _trusted_scalar_repr(v, t)
    if issubclass(t, type):  # a class (never isinstance: it may read a user __class__)
        return "<class '%s'>" % type_name(v)
    if t is types.FunctionType or t is types.BuiltinFunctionType:
        name = v.__qualname__  # a slot of these builtin types: no user code runs
        return "<function %s>" % (name[:STR_MAX] if type(name) is str else "?")
    return "<%s object>" % type_name(t)


def _trusted_scalar_repr(v, t):
    """numpy scalars and the like: item() gives a builtin value."""
    try:
        item = v.item
        if callable(item) and getattr(v, "shape", None) == ():
            x = item()
            if type(x) in _SCALARS or type(x) in (str, bytes):
                return safe_repr(x)
    except Exception:
        pass
    return "<%s object>" % type_name(t)


def _clip(r, entry):
    if len(r) > REPR_MAX:
        entry["truncated"] = True
        return r[:REPR_MAX - 3] + "..."
    return r


def _int_list(x):
    try:
        out = [int(d) for d in tuple(x)[:32]]
        return out if all(type(d) is int for d in out) else None
    except Exception:
        return None


def _str_cut(x, n=64):
    try:
        s = str(x)
    except Exception:
        return None
    return s[:n] if type(s) is str else None


def describe(name, v, with_repr=True):
    """One entry: {"name","type","repr", and where known "len","shape","dtype",...}."""
    t = type(v)
    entry = {"name": name[:REPR_MAX], "type": type_name(t)}
    if t in (str, bytes, bytearray, list, tuple, set, frozenset, dict, range):
        entry["len"] = len(v)
    if _trusted(t):
        try:
            _describe_trusted(v, t, entry, with_repr)
        except Exception as e:  # a library object that fails to describe itself
            entry["repr"] = "<%s object (%s)>" % (type_name(t), type_name(type(e)))
        entry.setdefault("repr", "<%s object>" % type_name(t))
        entry["repr"] = _clip(entry["repr"], entry)
        return entry
    try:
        entry["repr"] = _clip(safe_repr(v), entry) if with_repr else ""
    except Exception as e:  # RecursionError, MemoryError in a huge int, ...
        entry["repr"] = "<%s object (%s)>" % (type_name(t), type_name(type(e)))
    return entry


def _describe_trusted(v, t, entry, with_repr):
    shape = _int_list(v.shape) if hasattr(v, "shape") else None
    if shape is not None:
        entry["shape"] = shape
    columns = getattr(v, "columns", None) if hasattr(v, "columns") else None
    if columns is not None:
        cols = []
        for i, c in enumerate(columns):
            if i >= MAX_COLUMNS:
                break
            cols.append(safe_repr(c) if type(c) is not str else c[:STR_MAX])
        entry["columns"] = cols
        dtypes = getattr(v, "dtypes", None)
        if dtypes is not None:
            try:
                entry["dtypes"] = [_str_cut(d) for d in list(dtypes)[:MAX_COLUMNS]]
            except Exception:
                pass
    elif hasattr(v, "dtype"):
        d = _str_cut(v.dtype)
        if d is not None:
            entry["dtype"] = d
    nbytes = getattr(v, "nbytes", None)
    if type(nbytes) is int or (nbytes is not None and _trusted(type(nbytes))):
        try:
            entry["nbytes"] = int(nbytes)
        except Exception:
            pass
    if not with_repr:
        entry["repr"] = ""
        return
    if shape == [] or (shape is None and hasattr(v, "item")):
        entry["repr"] = _trusted_scalar_repr(v, t)
        return
    if columns is not None and hasattr(v, "head"):
        # A frame: its first rows as builtin values, columns cut.
        head = v.head(HEAD_ROWS)
        if hasattr(head, "iloc"):
            head = head.iloc[:, :MAX_COLUMNS]
        rows = head.values.tolist() if hasattr(head, "values") else None
        if type(rows) is list:
            entry["repr"] = "<%s %s> head: %s" % (
                type_name(t), "x".join(map(str, shape or [])), safe_repr(rows))
            return
    flat = getattr(v, "flat", None)
    if flat is not None:  # numpy: the first elements, without copying the array
        first = v.flat[:ITEMS_MAX].tolist()
        more = shape is not None and _product(shape) > ITEMS_MAX
        entry["repr"] = "<%s %s %s> %s%s" % (
            type_name(t), "x".join(map(str, shape or [])), entry.get("dtype", ""),
            safe_repr(first), " ..." if more else "")
        return
    if hasattr(v, "head") and hasattr(v, "tolist"):  # a pandas Series
        first = v.head(ITEMS_MAX).tolist()
        entry["repr"] = "<%s %s> %s" % (type_name(t), "x".join(map(str, shape or [])),
                                        safe_repr(first))
        return
    entry["repr"] = "<%s %s>" % (type_name(t), "x".join(map(str, shape or [])))


def _product(xs):
    p = 1
    for x in xs:
        p *= x
    return p


def _entries(items, max_bytes, deadline):
    """items: (name, value) pairs, already sorted. Entries that fit in max_bytes of JSON."""
    out, used = [], 2  # "[]"
    items = list(items)
    for i, (name, v) in enumerate(items):
        if i >= MAX_NAMES:
            break
        entry = describe(name, v, with_repr=time.monotonic() < deadline)
        text = json.dumps(entry, ensure_ascii=False)
        size = len(text.encode("utf-8", "surrogatepass")) + 2  # ", "
        if used + size > max_bytes - 160:  # room for the marker entry
            break
        out.append(entry)
        used += size
    omitted = len(items) - len(out)
    if omitted:
        out.append({"name": "...", "type": "truncated", "omitted": omitted,
                    "repr": "%d more variables not shown" % omitted})
    return out


def _visible(ns):
    names = []
    for k in dict.keys(ns):
        if type(k) is not str or k.startswith("_"):
            continue
        v = dict.get(ns, k)
        if issubclass(type(v), types.ModuleType):
            continue
        names.append(k)
    names.sort()
    return [(k, dict.get(ns, k)) for k in names]


def _dump(obj):
    text = json.dumps(obj, ensure_ascii=False)
    # Lone surrogates (from surrogateescape'd names) cannot be UTF-8: replace them.
    return text.encode("utf-8", "replace").decode("utf-8")


def summarize(ns, max_bytes=MAX_JSON_BYTES):
    """The variables of namespace dict `ns` as JSON text (≤ max_bytes bytes of UTF-8)."""
    deadline = time.monotonic() + TIME_BUDGET_S
    max_bytes = max(256, max_bytes)
    entries = _entries(_visible(ns), max_bytes, deadline)
    text = _dump(entries)
    while len(text.encode("utf-8")) > max_bytes and entries:  # never over the cap
        kept = [e for e in entries if e.get("type") != "truncated" or e.get("name") != "..."]
        if not kept:
            break
        kept.pop()
        omitted = len(_visible(ns)) - len(kept)
        entries = kept + [{"name": "...", "type": "truncated", "omitted": omitted,
                           "repr": "%d more variables not shown" % omitted}]
        text = _dump(entries)
    return text


def summarize_step(ns, tb=None, skip_files=(), max_bytes=MAX_JSON_BYTES):
    """What a step records: the namespace's variables and, after an error (`tb`), the locals
    of each frame of its traceback as further entries with a "frame" field ("function
    (file:line)"), as one JSON array of at most max_bytes bytes (the frames get up to 3/8)."""
    if tb is None:
        return summarize(ns, max_bytes)
    max_bytes = max(1024, max_bytes)
    frames = json.loads(summarize_traceback(tb, skip_files, max_bytes * 3 // 8))
    extra = []
    for f in frames:
        where = "%s (%s:%s)" % (f["function"], f["file"], f["line"])
        for v in f["variables"]:
            v["frame"] = where[:REPR_MAX]
            extra.append(v)
    tail = _dump(extra)
    room = max_bytes - len(tail.encode("utf-8")) - 2
    head = json.loads(summarize(ns, max(256, room)))
    text = _dump(head + extra)
    while len(text.encode("utf-8")) > max_bytes and extra:
        extra.pop()
        text = _dump(head + extra)
    return text


def summarize_traceback(tb, skip_files=(), max_bytes=MAX_JSON_BYTES):
    """The locals of each frame of traceback `tb` (innermost MAX_FRAMES, frames whose file is
    in skip_files left out), as JSON text of at most max_bytes bytes: outermost first, each
    {"function","file","line","variables":[...]} with the frame's share of the budget."""
    frames = []
    while tb is not None:
        f = tb.tb_frame
        if f.f_code.co_filename not in skip_files:
            frames.append((f, tb.tb_lineno))
        tb = tb.tb_next
    frames = frames[-MAX_FRAMES:]
    deadline = time.monotonic() + TIME_BUDGET_S
    share = max(256, (max(256, max_bytes) - 16) // max(1, len(frames)))
    out = []
    for f, line in frames:
        code = f.f_code
        head = {"function": code.co_name[:REPR_MAX], "file": code.co_filename[:REPR_MAX],
                "line": line}
        room = share - len(_dump(head)) - 32
        try:
            local_vars = dict(f.f_locals)
        except Exception:
            local_vars = {}
        if code.co_name == "<module>":  # a cell's frame: its locals are the whole namespace
            local_vars = {}
        head["variables"] = _entries(_visible(local_vars), max(256, room), deadline)
        out.append(head)
    text = _dump(out)
    while len(text.encode("utf-8")) > max_bytes and out:  # never over the cap
        out.pop(0)
        text = _dump(out)
    return text
