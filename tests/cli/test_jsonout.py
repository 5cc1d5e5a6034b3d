"""emit_json: the one --json printer (one line of strict JSON on stdout)."""
import math

import pytest

from ddtree.jsonout import emit_json


def test_one_line_with_the_bytes_json_dumps_writes(capsys):
    emit_json({"text": "é\n", "tokens": [1, 2], "stats": {"wall_s": 0.25, "ok": True, "plans": None}})
    out, err = capsys.readouterr()
    assert out == '{"text": "\\u00e9\\n", "tokens": [1, 2], "stats": {"wall_s": 0.25, "ok": true, "plans": null}}\n'
    assert err == ""


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_number_is_an_error_naming_where(capsys, bad):
    with pytest.raises(ValueError, match=r"\$\.rows\[1\]\.gbps is not a finite number"):
        emit_json({"rows": [{"gbps": 1.0}, {"gbps": bad}]})
    assert capsys.readouterr().out == ""                  # nothing half-written on stdout
