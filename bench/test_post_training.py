"""Post-training heads (``pytest bench/ --benchmark-only``): the rows of the GPU suite's ``post_training`` section
(``ops_suite.post_training_rows``: log-prob + entropy forward, fused CE + entropy + accuracy, GRPO and the fused
linear JSD against the materialised-logits torch path and Liger's when installed), here at a smoke shape on CPU."""

import pytest

from benchutil import ON_GPU


def test_post_training_rows(benchmark):
    import torch
    from ops_suite import post_training_rows

    device = torch.device("cuda" if ON_GPU else "cpu")
    rows = benchmark.pedantic(lambda: post_training_rows(device, smoke=not ON_GPU), rounds=1, iterations=1)
    failed = [r for r in rows if "error" in r and r["impl"] == "tritonlm"]
    assert not failed, failed
    groups = {r["group"] for r in rows}
    assert {"logp+entropy fwd", "grpo fwd+bwd", "fused linear jsd fwd+bwd"} <= groups
    benchmark.extra_info["rows"] = rows
    # the GPU report's verdicts read these rows: the speed-up and memory ones appear for the measured groups
    from verdicts import verdicts

    targets = {v["target"] for v in verdicts({"sections": {"post_training": {"rows": rows}}})}
    assert "post-training log-prob + entropy fwd: >= 10x the materialised-logits path" in targets, targets
    assert "post-training grpo fwd+bwd: peak memory <= 1/10 the materialised-logits path" in targets, targets
    if not rows:
        pytest.fail("no rows")
