"""Arrow columns built from buffers equal what pa.array builds from the same values."""
import numpy as np
import pyarrow as pa
import pytest

from drafter_data.arrow_columns import bool_array, numpy_array, repeated_string, string_array


@pytest.mark.parametrize("values", [
    [], [None, None], ["a", "bc", ""], ["é", None, "x", "日本", None], ["", None, ""], ["plain"] * 5 + [None],
])
def test_strings_equal_pa_array(values):
    built = string_array(values)
    built.validate(full=True)
    assert built.equals(pa.array(values, pa.string()))


@pytest.mark.parametrize("type_", [pa.int8(), pa.int32(), pa.int64()])
def test_integers_equal_pa_array_whatever_the_input_layout(type_):
    base = np.arange(-50, 50, dtype=np.int64)
    for values in (base, base[::3], base[::-1], base.astype(">i8"), base.astype(np.uint32 if type_ != pa.int8() else
                                                                                   np.int16)[50:]):
        built = numpy_array(values, type_)
        built.validate(full=True)
        assert built.to_pylist() == [int(v) for v in values]


def test_bools_and_repeated_strings_equal_pa_array():
    mask = np.array([True, False, True, True, False, False, False, True, True], bool)
    assert bool_array(mask).equals(pa.array(mask.tolist()))
    assert repeated_string("ab", 4).equals(pa.array(["ab"] * 4))
    assert repeated_string("", 3).equals(pa.array([""] * 3))


def test_a_two_dimensional_array_is_refused_not_cut():
    with pytest.raises(ValueError, match="1-d"):
        numpy_array(np.zeros((3, 2), np.int32), pa.int32())
    with pytest.raises(ValueError, match="1-d"):
        bool_array(np.zeros((2, 8), bool))
