"""Two small spec features of the state-space families:

* a ``params`` module's parameter with ``when`` exists only when it holds (Mamba's conv1d bias,
  ``use_conv_bias``), as a ``replicated`` module's already could;
* ``int(x)`` in expressions, Python's truncation of a float (LFM2's MLP width
  ``int(2 * ff / 3)`` times a float multiplier).
"""

from __future__ import annotations

import pytest

from functional_load.errors import ConfigError
from functional_load.layout.build import build_layout
from functional_load.layout.parallel import Parallel
from functional_load.model.expressions import evaluate
from functional_load.model.spec import parse_spec

_SPEC = {
    "name": "tiny_conv",
    "layers": "1",
    "modules": {
        "mixer.conv1d": {
            "kind": "params",
            "params": {
                "weight": {"shape": ["16", 1, "4"], "split": 0},
                "bias": {"shape": ["16"], "split": 0, "when": "use_conv_bias"},
            },
        },
        "mlp.up": {"kind": "column", "in": "8", "out": "int(mult * int(2 * ff / 3))"},
    },
}


@pytest.mark.parametrize("bias", [True, False])
def test_a_params_parameter_exists_when_its_when_holds(bias: bool) -> None:
    layout = build_layout({"use_conv_bias": bias, "mult": 1.0, "ff": 24}, parse_spec(_SPEC), Parallel(2, 1), "bfloat16")
    assert layout.params["mixer.conv1d.weight"].local_shape == (8, 1, 4)
    assert ("mixer.conv1d.bias" in layout.params) is bias
    if bias:
        assert layout.params["mixer.conv1d.bias"].local_shape == (8,)
    assert layout.params["mlp.up.weight"].shape == (16, 8)  # int(1.0 * int(48 / 3))


def test_int_truncates_as_python() -> None:
    assert evaluate("int(2 * 144 / 3)", {}) == 96
    assert evaluate("int(x)", {"x": 7.9}) == 7 and evaluate("int(x)", {"x": -7.9}) == -7
    assert isinstance(evaluate("int(1.0 * 64)", {}), int)
    with pytest.raises(ConfigError, match=r"config\.json has no 'y'"):
        evaluate("int(y)", {"y": None})
    with pytest.raises(ConfigError, match="not a number"):
        evaluate("int(y)", {"y": "auto"})
