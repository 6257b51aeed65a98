"""The ``/render`` frame format (`gym_sessions.frames`), in process: encode, decode, refusals."""

from __future__ import annotations

import numpy as np
import pytest

from gym_sessions.frames import (
    FRAME_DTYPE_HEADER,
    FRAME_LIST_HEADER,
    FRAME_SHAPE_HEADER,
    EncodedFrame,
    decode_frame,
    encode_frame,
)

OCTETS = "application/octet-stream"


def round_trip(frame):
    """``frame`` encoded, then decoded as a client receives it (lower-case header names)."""
    encoded = encode_frame(frame)
    headers = {name.lower(): value for name, value in encoded.headers.items()}
    if encoded.media_type is not None:
        headers["content-type"] = encoded.media_type
    return decode_frame(encoded.status, headers, encoded.body)


def array_headers(dtype: str, shape: str, **extra: str) -> dict[str, str]:
    return {
        "content-type": OCTETS,
        FRAME_DTYPE_HEADER: dtype,
        FRAME_SHAPE_HEADER: shape,
        **extra,
    }


# Encoding ---------------------------------------------------------------------------------


def test_an_rgb_array_is_raw_bytes_with_dtype_and_shape_headers():
    frame = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    assert encode_frame(frame) == EncodedFrame(
        200,
        OCTETS,
        bytes(range(18)),
        {FRAME_DTYPE_HEADER: "|u1", FRAME_SHAPE_HEADER: "2,3,3"},
    )


def test_the_dtype_header_keeps_the_byte_order():
    frame = np.array([1.0, -2.5], dtype=">f4")
    encoded = encode_frame(frame)
    assert encoded.headers[FRAME_DTYPE_HEADER] == ">f4"
    assert encoded.body == b"\x3f\x80\x00\x00\xc0\x20\x00\x00"


def test_a_numpy_scalar_is_a_frame_with_an_empty_shape():
    encoded = encode_frame(np.float32(1.5))
    assert encoded.headers == {FRAME_DTYPE_HEADER: "<f4", FRAME_SHAPE_HEADER: ""}
    assert encoded.body == np.float32(1.5).tobytes()


def test_a_non_contiguous_array_is_sent_in_c_order():
    base = np.arange(12, dtype=np.int16).reshape(3, 4)
    view = base[:, ::2].T  # shape (2, 3), neither C- nor F-contiguous
    encoded = encode_frame(view)
    assert encoded.headers[FRAME_SHAPE_HEADER] == "2,3"
    assert encoded.body == np.array([[0, 4, 8], [2, 6, 10]], dtype=np.int16).tobytes()


def test_a_fortran_ordered_array_is_sent_in_c_order():
    frame = np.asfortranarray(np.arange(6, dtype=np.uint8).reshape(2, 3))
    assert encode_frame(frame).body == bytes([0, 1, 2, 3, 4, 5])
    np.testing.assert_array_equal(round_trip(frame), frame)


def test_a_string_is_utf8_text_without_frame_headers():
    assert encode_frame("count=3 \u00e9\n") == EncodedFrame(
        200, "text/plain; charset=utf-8", "count=3 \u00e9\n".encode()
    )


def test_none_is_204_without_body():
    assert encode_frame(None) == EncodedFrame(204, None, b"", {})


def test_a_list_of_frames_is_stacked_and_marked():
    frames = [np.full((2, 2), i, dtype=np.uint8) for i in range(3)]
    encoded = encode_frame(frames)
    assert encoded.headers == {
        FRAME_DTYPE_HEADER: "|u1",
        FRAME_SHAPE_HEADER: "3,2,2",
        FRAME_LIST_HEADER: "1",
    }
    assert encoded.body == bytes([0] * 4 + [1] * 4 + [2] * 4)


def test_an_empty_list_of_frames_is_an_empty_marked_array():
    encoded = encode_frame([])
    assert encoded.status == 200
    assert encoded.headers == {
        FRAME_DTYPE_HEADER: "|u1",
        FRAME_SHAPE_HEADER: "0",
        FRAME_LIST_HEADER: "1",
    }
    assert encoded.body == b""


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (np.array([object()]), "cannot send a frame of dtype object"),
        (np.zeros(2, dtype=[("x", "i4"), ("y", "f4")]), "cannot send a frame of dtype"),
        ([np.zeros(2), np.zeros(3)], "different shapes or dtypes"),
        ([np.zeros(2, np.uint8), np.zeros(2, np.int8)], "different shapes or dtypes"),
        ([np.zeros(2), "not an array"], "cannot send a frame of type list"),
        ([1, 2, 3], "cannot send a frame of type list"),
        (b"\x00\x01", "cannot send a frame of type bytes"),
        (3, "cannot send a frame of type int"),
        ({"frame": 1}, "cannot send a frame of type dict"),
    ],
)
def test_frames_the_format_cannot_carry_are_type_errors(frame, message):
    with pytest.raises(TypeError, match=message):
        encode_frame(frame)


# Decoding ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frame",
    [
        np.arange(24, dtype=np.uint8).reshape(2, 4, 3),
        np.array([[1.5, -2.0]], dtype=">f8"),
        np.array([True, False, True]),
        np.array(7, dtype=np.int64),
        np.zeros((0, 3), dtype=np.float32),
        np.array(["ab", "c"]),  # fixed-width unicode, no objects
    ],
)
def test_arrays_round_trip_with_dtype_and_shape(frame):
    decoded = round_trip(frame)
    assert isinstance(decoded, np.ndarray)
    assert decoded.dtype == frame.dtype and decoded.dtype.str == frame.dtype.str
    assert decoded.shape == frame.shape
    np.testing.assert_array_equal(decoded, frame)


def test_a_decoded_array_is_writable():
    # np.frombuffer on the reply's bytes is read-only; callers may draw on their frame.
    decoded = round_trip(np.zeros((2, 2), dtype=np.uint8))
    assert decoded.flags.writeable
    decoded[0, 0] = 9
    assert decoded[0, 0] == 9


def test_a_list_of_frames_comes_back_as_a_list_of_arrays():
    frames = [np.full((2, 3), i, dtype=np.int32) for i in range(4)]
    decoded = round_trip(frames)
    assert isinstance(decoded, list) and len(decoded) == 4
    for got, sent in zip(decoded, frames, strict=True):
        assert isinstance(got, np.ndarray) and got.shape == (2, 3)
        np.testing.assert_array_equal(got, sent)


def test_a_tuple_of_frames_is_a_list_too():
    decoded = round_trip((np.ones(2, np.uint8), np.zeros(2, np.uint8)))
    assert [list(f) for f in decoded] == [[1, 1], [0, 0]]


def test_an_empty_list_comes_back_empty():
    assert round_trip([]) == []


def test_text_and_nothing_round_trip():
    assert round_trip("count=3\n") == "count=3\n"
    assert round_trip("") == ""
    assert round_trip(None) is None


def test_204_is_none_whatever_the_headers_say():
    assert decode_frame(204, {"content-type": "text/plain"}, b"junk") is None


def test_the_content_type_parameters_are_ignored():
    headers = array_headers("|u1", "2")
    headers["content-type"] = "application/octet-stream ; x=1"
    assert decode_frame(200, headers, b"\x01\x02").tolist() == [1, 2]
    assert decode_frame(200, {"content-type": "text/plain;charset=utf-8"}, b"ok") == "ok"


def test_a_list_header_other_than_1_is_no_list():
    decoded = decode_frame(200, array_headers("|u1", "2", **{FRAME_LIST_HEADER: "0"}), b"\x01\x02")
    assert isinstance(decoded, np.ndarray) and decoded.tolist() == [1, 2]


@pytest.mark.parametrize("content_type", [None, "application/json", "image/png", ""])
def test_other_content_types_are_not_frames(content_type):
    headers = {} if content_type is None else {"content-type": content_type}
    with pytest.raises(ValueError, match="is not a frame"):
        decode_frame(200, headers, b'{"error": {}}')


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        ({"content-type": OCTETS, FRAME_SHAPE_HEADER: "2"}, b"\x01\x02"),  # no dtype
        ({"content-type": OCTETS, FRAME_DTYPE_HEADER: "|u1"}, b"\x01\x02"),  # no shape
        (array_headers("|u1", "3"), b"\x01\x02"),  # too short for the shape
        (array_headers("<f4", "1"), b"\x01\x02"),  # not a whole element
        (array_headers("no-such-dtype", "2"), b"\x01\x02"),
        (array_headers("|u1", "a,b"), b"\x01\x02"),
        (array_headers("|O", "1"), b"\x00" * 8),  # objects cannot come from bytes
    ],
)
def test_malformed_array_replies_are_value_errors(headers, body):
    with pytest.raises(ValueError, match="malformed frame reply"):
        decode_frame(200, headers, body)


def test_a_list_header_on_a_scalar_shape_is_a_value_error():
    with pytest.raises(ValueError):
        decode_frame(200, array_headers("|u1", "", **{FRAME_LIST_HEADER: "1"}), b"\x05")
