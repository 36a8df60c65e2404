import pytest

from ucmagic.errors import SizeParseError
from ucmagic.units import format_size, parse_size


@pytest.mark.parametrize("text,expected", [
    ("50GB", 50 * 10**9), ("1.5GiB", int(1.5 * 2**30)), ("200 mb", 200 * 10**6), ("10k", 10_000),
    ("512", 512), ("0", 0), (1024, 1024), (2.5e3, 2500), (None, None), ("3KiB", 3072), ("1TB", 10**12),
])
def test_parse_size_accepts_common_spellings(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["50 GBs", "abc", "-5MB", "", "5 5", -1, True, [1]])
def test_parse_size_rejects_bad_input_with_a_hint(bad):
    with pytest.raises(SizeParseError) as e:
        parse_size(bad)
    assert "size" in str(e.value)


def test_format_size_is_human_readable():
    assert format_size(999) == "999 B"
    assert format_size(1_500_000) == "1.5 MB"
    assert format_size(2 * 10**12) == "2.0 TB"
