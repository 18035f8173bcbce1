"""The numpy-over-msgpack decoder: all three dialects in, openpi out, and never anything but WireError."""

from __future__ import annotations

import base64

import msgpack
import msgpack_numpy
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from openpi_client import msgpack_numpy as openpi_msgpack

from wamrt.client.wire import WireError, json_array, packb, unpackb

DTYPES = st.sampled_from(["uint8", "int16", "int32", "int64", "float16", "float32", "float64", "bool", ">f4"])
ARRAYS = DTYPES.flatmap(lambda dt: hnp.arrays(np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=4, max_side=5)))


def _vllm_native(arr: np.ndarray) -> dict:
    return {"nd": True, "type": arr.dtype.str, "kind": "", "shape": list(arr.shape), "data": arr.tobytes()}


def _same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@settings(max_examples=60, deadline=None)
@given(ARRAYS)
def test_openpi_client_packer_decodes(arr: np.ndarray) -> None:
    _same(unpackb(openpi_msgpack.packb({"x": arr}))["x"], arr)


@settings(max_examples=60, deadline=None)
@given(ARRAYS)
def test_msgpack_numpy_packer_decodes(arr: np.ndarray) -> None:
    _same(unpackb(msgpack.packb({"x": arr}, default=msgpack_numpy.encode))["x"], arr)


@settings(max_examples=60, deadline=None)
@given(ARRAYS)
def test_vllm_native_markers_decode(arr: np.ndarray) -> None:
    _same(unpackb(msgpack.packb({"x": _vllm_native(arr)}))["x"], arr)


@settings(max_examples=60, deadline=None)
@given(ARRAYS)
def test_our_packer_is_read_by_openpi_client(arr: np.ndarray) -> None:
    _same(openpi_msgpack.unpackb(packb({"x": arr}))["x"], arr)
    _same(unpackb(packb({"x": arr}))["x"], arr)


@given(st.sampled_from([np.float32(1.5), np.int64(-3), np.uint8(7), np.bool_(True), np.float64(2.25)]))
def test_scalars_in_every_dialect(value: np.generic) -> None:
    for blob in (openpi_msgpack.packb(value), msgpack.packb(value, default=msgpack_numpy.encode), packb(value)):
        out = unpackb(blob)
        assert out == value and np.asarray(out).dtype == value.dtype


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_only_raise_wire_error(blob: bytes) -> None:
    try:
        unpackb(blob)
    except WireError:
        pass


MARKER = st.fixed_dictionaries({
    b"__ndarray__": st.just(True),
    b"data": st.binary(max_size=64),
    b"dtype": st.one_of(st.sampled_from(["<f4", "|u1", "|O", "<c8", "V8", "nonsense", "<M8[s]"]),
                        st.integers(-(2**40), 2**40)),
    b"shape": st.one_of(st.lists(st.integers(-2, 20), max_size=10), st.text(max_size=3), st.none()),
})


@settings(max_examples=300, deadline=None)
@given(MARKER)
def test_hostile_markers_are_refused_cleanly(marker: dict) -> None:
    try:
        out = unpackb(msgpack.packb({"x": marker}))
    except WireError:
        return
    arr = out["x"]
    assert isinstance(arr, np.ndarray) and arr.dtype.kind in "biuf"
    assert arr.nbytes == len(marker[b"data"])


@pytest.mark.parametrize("dtype", ["|O", "<c16", "V4", "<M8[s]"])
def test_object_complex_void_datetime_rejected(dtype: str) -> None:
    blob = msgpack.packb({"x": {b"__ndarray__": True, b"data": b"\0" * 16, b"dtype": dtype, b"shape": [1]}})
    with pytest.raises(WireError):
        unpackb(blob)


def test_size_limit() -> None:
    with pytest.raises(WireError, match="limit"):
        unpackb(packb({"x": b"\0" * 100}), max_bytes=50)


def test_json_arrays() -> None:
    img = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    raw = {"b64": base64.b64encode(img.tobytes()).decode(), "dtype": "uint8", "shape": [2, 3, 3]}
    _same(json_array(raw, "img"), img)
    assert json_array([[1, 2], [3, 4]], "j").shape == (2, 2)
    with pytest.raises(WireError):
        json_array([[1, 2], [3]], "ragged")
    with pytest.raises(WireError):
        json_array({"b64": "!!!"}, "bad")
    with pytest.raises(WireError):
        json_array({"b64": base64.b64encode(b"not an image").decode()}, "bad")
