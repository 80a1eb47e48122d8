"""``tritonlm train``'s options are TrainConfig's fields: one field is one option (help, type, default, check), and
a config with a refused value is a one-line error when it is made."""

import dataclasses

import pytest

from tritonlm.cli import build_parser
from tritonlm.train import MODEL_FLAGS, TrainConfig, TrainError


def _train_parser():
    return build_parser()._subparsers._group_actions[0].choices["train"]


def test_every_field_is_an_option_with_its_default():
    parser = _train_parser()
    flags = {opt for action in parser._actions for opt in action.option_strings}
    fields = dataclasses.fields(TrainConfig)
    options = {f.name: f.metadata["flag"] or "--" + f.name.replace("_", "-") for f in fields
               if f.metadata["flag"] is not None}
    assert set(options.values()) <= flags
    assert {"--" + name.replace("_", "-") for name in MODEL_FLAGS} <= flags
    # no arguments: the dataclass's own defaults, no overrides
    assert TrainConfig.from_args(parser.parse_args([])) == TrainConfig()
    args = parser.parse_args(["--lr", "0.01", "--no-progress", "--prompt", "Hi", "--d-model", "64", "--compile"])
    cfg = TrainConfig.from_args(args)
    assert (cfg.lr, cfg.progress, cfg.sample_prompt, cfg.model_overrides, cfg.compile) == (0.01, False, "Hi",
                                                                                           {"d_model": 64}, True)
    for f in fields:  # every option says what it does
        if f.metadata["flag"] is not None:
            assert f.metadata["help"], f.name


@pytest.mark.parametrize("changes, named", [
    ({"lr": -1.0}, "--lr -1.0: must be a positive number"), ({"max_steps": 0}, "--max-steps 0: must be positive"),
    ({"label_smoothing": 2.0}, "--label-smoothing 2.0"), ({"min_lr": 1.0}, "--min-lr 1.0"),
    ({"betas": (0.9, 1.0)}, "betas (0.9, 1.0)"), ({"resume": True, "overwrite": True}, "contradict"),
])
def test_refused_values_are_one_line_errors_when_the_config_is_made(changes, named):
    with pytest.raises(TrainError, match=named.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**changes)
