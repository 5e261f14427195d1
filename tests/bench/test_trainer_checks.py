"""The benchmark's in-process Trainer (megatron/training.py) refuses bad shapes and layouts naming the flag."""

import pytest

from megatron_longctx.megatron.training import GPTShape
from tests.dist import run_ranks


@pytest.mark.parametrize("kwargs, flag", [
    (dict(hidden_size=30, num_attention_heads=4), "--hidden-size"),
    (dict(num_attention_heads=4, num_query_groups=3), "--num-query-groups"),
    (dict(seq_length=0), "--seq-length"),
])
def test_bad_model_shape_names_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        GPTShape(**kwargs)


def _bad_layout(argv):
    from megatron_longctx import cpu_compat
    from megatron_longctx.megatron.training import OptimConfig, Trainer, Variant

    shape = GPTShape(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                       seq_length=130)
    messages = []
    with cpu_compat.enabled():
        for variant, gbs in ((Variant("p", context_parallel_size=2, plugin=True), 2), (Variant("b"), 3)):
            try:
                Trainer(shape if variant.plugin else GPTShape(seq_length=128), variant, OptimConfig(), gbs, 1)
            except ValueError as exc:
                messages.append(str(exc))
    return messages


def test_bad_layout_names_the_flag():
    messages = run_ranks(2, _bad_layout, [])[0]
    assert len(messages) == 2
    assert "--seq-length 130" in messages[0] and "--context-parallel-size" in messages[0]
    assert "--global-batch-size 3" in messages[1]
