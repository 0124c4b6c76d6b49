"""esb_vars.py (src/agent/python/esb_vars.py): the bounded variables summary of time travel,
run on the host from its home in the tree. numpy/pandas are not installed on the host, so the
array and frame paths are exercised with stand-in classes whose module is "numpy"/"pandas"
(the summary recognises them by duck typing, exactly as it does the real ones)."""
import importlib.util
import json
import pathlib
import sys
import time

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "agent" / "python" / "esb_vars.py"
spec = importlib.util.spec_from_file_location("esb_vars_under_test", SRC)
ev = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ev)


def summary(ns, **kw):
    text = ev.summarize(ns, **kw)
    assert len(text.encode("utf-8")) <= kw.get("max_bytes", ev.MAX_JSON_BYTES)
    return json.loads(text)


def by_name(entries):
    return {e["name"]: e for e in entries}


def test_builtin_values_have_types_reprs_and_lengths():
    ns = {"a": 1, "s": "hi", "l": [1, 2, 3], "d": {"k": (1, 2)}, "f": 1.5, "n": None,
          "b": b"\x00x", "st": {3}, "fs": frozenset(), "r": range(3), "t": (1,), "c": 2j}
    e = by_name(summary(ns))
    assert e["a"] == {"name": "a", "type": "int", "repr": "1"}
    assert e["s"]["repr"] == "'hi'" and e["s"]["len"] == 2
    assert e["l"]["repr"] == "[1, 2, 3]" and e["l"]["len"] == 3
    assert e["d"]["repr"] == "{'k': (1, 2)}"
    assert e["b"]["repr"] == "b'\\x00x'"
    assert e["st"]["repr"] == "{3}" and e["fs"]["repr"] == "frozenset()"
    assert e["t"]["repr"] == "(1,)" and e["r"]["repr"] == "range(0, 3)"
    assert e["n"]["type"] == "NoneType" and e["c"]["repr"] == "2j"


def test_private_names_and_modules_are_left_out_and_names_are_sorted():
    ns = {"z": 1, "_hidden": 2, "__builtins__": __builtins__, "json": json, "a": 3}
    assert [x["name"] for x in summary(ns)] == ["a", "z"]


def test_large_values_are_cut():
    ns = {"big": "x" * 10_000_000, "lst": list(range(1_000_000)),
          "dct": {i: i for i in range(100_000)}, "huge_int": 1 << 100_000,
          "nested": [[[[[[1]]]]]]}
    start = time.monotonic()
    e = by_name(summary(ns))
    assert time.monotonic() - start < 1.0
    assert len(e["big"]["repr"]) <= ev.REPR_MAX and e["big"]["len"] == 10_000_000
    assert e["lst"]["repr"].endswith("...]") and e["lst"]["len"] == 1_000_000
    assert e["dct"]["len"] == 100_000 and e["dct"]["repr"].endswith("...}")
    assert e["huge_int"]["repr"] == "<int of 100001 bits>"
    assert "[...]" in e["nested"]["repr"]


class Sneaky:
    """A user class: its __repr__, properties and __getattr__ must never run."""
    calls = []

    def __repr__(self):
        Sneaky.calls.append("repr")
        return "sneaky"

    @property
    def shape(self):
        Sneaky.calls.append("shape")
        return (1, 2)

    def __getattr__(self, name):
        Sneaky.calls.append(name)
        raise AttributeError(name)

    @property
    def __class__(self):
        Sneaky.calls.append("__class__")
        return int


class SneakyList(list):
    def __repr__(self):
        Sneaky.calls.append("list repr")
        return "x"

    def __iter__(self):
        Sneaky.calls.append("list iter")
        return iter([])


def test_user_repr_and_attributes_are_never_called():
    Sneaky.calls.clear()
    ns = {"obj": Sneaky(), "inside": [Sneaky(), {"k": Sneaky()}], "sub": SneakyList([1]),
          "cls": Sneaky}
    e = by_name(summary(ns))
    assert Sneaky.calls == []
    assert e["obj"]["repr"] == "<%s.Sneaky object>" % __name__
    assert e["obj"]["type"] == "%s.Sneaky" % __name__
    assert "shape" not in e["obj"]
    assert e["inside"]["repr"].startswith("[<") and "Sneaky object>" in e["inside"]["repr"]
    assert e["sub"]["repr"] == "<%s.SneakyList object>" % __name__
    assert e["cls"]["repr"] == "<class '%s.Sneaky'>" % __name__


class Meta(type):
    def __getattribute__(cls, name):
        Sneaky.calls.append("meta " + name)
        return super().__getattribute__(name)


class WithMeta(metaclass=Meta):
    pass


def test_a_metaclass_cannot_forge_or_run_code_through_the_type_name():
    Sneaky.calls.clear()
    e = by_name(summary({"w": WithMeta()}))
    assert Sneaky.calls == []
    assert e["w"]["type"].endswith("WithMeta")


# Stand-ins for numpy and pandas objects (module names are what the summary trusts).
class FakeFlat:
    def __init__(self, values):
        self.values = values

    def __getitem__(self, s):
        return FakeArray(self.values[s])


class FakeArray:
    def __init__(self, values, shape=None):
        self._values = list(values)
        self.shape = tuple(shape or (len(self._values),))
        self.dtype = "float64"
        self.nbytes = 8 * len(self._values)

    @property
    def flat(self):
        return FakeFlat(self._values)

    def tolist(self):
        return list(self._values)


FakeArray.__module__ = "numpy"
FakeArray.__qualname__ = "ndarray"


class FakeFrame:
    def __init__(self, rows, columns):
        self.rows, self.columns = rows, columns
        self.shape = (len(rows), len(columns))
        self.dtypes = ["int64"] * len(columns)

    def head(self, n):
        return FakeFrame(self.rows[:n], self.columns)

    @property
    def iloc(self):
        frame = self

        class Loc:
            def __getitem__(self, key):
                return frame
        return Loc()

    @property
    def values(self):
        return FakeArray([], shape=(0,)) if False else _Rows(self.rows)


class _Rows:
    def __init__(self, rows):
        self.rows = rows

    def tolist(self):
        return [list(r) for r in self.rows]


FakeFrame.__module__ = "pandas.core.frame"
FakeFrame.__qualname__ = "DataFrame"


def test_arrays_and_frames_report_shape_dtype_and_first_values():
    arr = FakeArray(range(10_000_000 // 1000), shape=(100, 100))
    df = FakeFrame([(i, i * 2) for i in range(1000)], ["a", "b"])
    e = by_name(summary({"arr": arr, "df": df}))
    assert e["arr"]["type"] == "numpy.ndarray"
    assert e["arr"]["shape"] == [100, 100] and e["arr"]["dtype"] == "float64"
    assert e["arr"]["nbytes"] == 80_000
    assert "[0, 1, 2, 3, 4, 5, 6, 7]" in e["arr"]["repr"] and e["arr"]["repr"].endswith("...")
    assert e["df"]["type"] == "pandas.core.frame.DataFrame"
    assert e["df"]["shape"] == [1000, 2] and e["df"]["columns"] == ["a", "b"]
    assert e["df"]["dtypes"] == ["int64", "int64"]
    assert "[[0, 0], [1, 2], [2, 4]]" in e["df"]["repr"]


def test_the_json_never_exceeds_its_cap_and_says_what_it_left_out():
    ns = {"v%04d" % i: "y" * 1000 for i in range(2000)}
    for cap in (ev.MAX_JSON_BYTES, 4096, 300):
        entries = summary(ns, max_bytes=cap)
        assert entries[-1]["type"] == "truncated"
        assert entries[-1]["omitted"] == 2000 - (len(entries) - 1)


def test_unicode_and_lone_surrogates_stay_valid_utf8():
    ns = {"s": "é\udcff", "n\udcffame": 1, "emoji": "\U0001F600" * 10_000}
    entries = summary(ns, max_bytes=2048)
    assert {e["name"] for e in entries} >= {"emoji", "s"}


def test_a_value_that_fails_to_describe_does_not_lose_the_summary():
    class Boom:
        pass
    Boom.__module__ = "numpy"
    b = Boom()
    b.shape = property(lambda s: 1 / 0)  # an instance attribute, not a descriptor: fine
    e = by_name(summary({"b": b, "ok": 1}))
    assert e["ok"]["repr"] == "1" and e["b"]["type"] == "numpy.%s" % Boom.__qualname__


def test_frame_locals_of_a_traceback():
    def inner(x):
        secret = {"a": [1, 2, 3]}
        local_obj = Sneaky()
        return 1 / 0

    def outer():
        y = "text"
        return inner(41)

    Sneaky.calls.clear()
    try:
        outer()
    except ZeroDivisionError:
        tb = sys.exc_info()[2]
    frames = json.loads(ev.summarize_traceback(tb))
    assert Sneaky.calls == []
    assert [f["function"] for f in frames][-2:] == ["outer", "inner"]
    inner_vars = by_name(frames[-1]["variables"])
    assert inner_vars["x"]["repr"] == "41"
    assert inner_vars["secret"]["repr"] == "{'a': [1, 2, 3]}"
    assert frames[-1]["line"] > 0 and frames[-1]["file"] == __file__
    assert by_name(frames[-2]["variables"])["y"]["repr"] == "'text'"
    # skip_files leaves the test's own frames out.
    assert json.loads(ev.summarize_traceback(tb, skip_files=(__file__,))) == []


def test_frame_locals_stay_under_the_cap_for_deep_recursion():
    def rec(n, payload):
        if n == 0:
            raise ValueError("bottom")
        return rec(n - 1, payload)

    try:
        rec(200, "p" * 5000)
    except ValueError:
        tb = sys.exc_info()[2]
    text = ev.summarize_traceback(tb, max_bytes=8192)
    assert len(text.encode()) <= 8192
    frames = json.loads(text)
    assert 0 < len(frames) <= ev.MAX_FRAMES and frames[-1]["function"] == "rec"
