"""Suite loading: the default suite, overrides, and clear errors for malformed files."""
import pytest

from kosmos_bench.suites import DEFAULT_SUITE, SuiteError, TPSuite, default_suite, load_suite


def test_default_suite_file_loads():
    s = load_suite(DEFAULT_SUITE)
    assert s.bench == "tp" and "llama3-70b" in s.models and s.seq == (4096, 8192, 16384)
    assert set(s.fixed_sweep) >= {8, 16, 24, 32, 48, 64}
    assert default_suite() == s


def test_override_keeps_unset_fields():
    s = TPSuite().override(models=("llama3-8b",), seq=None, iters=3)
    assert s.models == ("llama3-8b",) and s.seq == TPSuite().seq and s.iters == 3


@pytest.mark.parametrize("text, needle", [
    ("models: [llama9-1t]\n", "unknown models"),
    ("seq: [4096, -1]\n", "positive integers"),
    ("impls: [kosmos, magic]\n", "unknown impls"),
    ("iters: 0\n", "iters"),
    ("colour: blue\n", "unknown key"),
    ("- just\n- a list\n", "mapping"),
    ("models: [llama3-8b\n", "not valid YAML"),
    ("dtype: fp4\n", "unknown dtype"),
    ("layers: [qkv, mlp]\n", "unknown layers"),
])
def test_malformed_suite_gives_clear_error(tmp_path, text, needle):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(SuiteError, match=needle) as e:
        load_suite(p)
    assert str(p) in str(e.value)


def test_missing_suite_file(tmp_path):
    with pytest.raises(SuiteError, match="does not exist"):
        load_suite(tmp_path / "nope.yaml")
