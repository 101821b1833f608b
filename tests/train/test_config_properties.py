"""Property: the batch arithmetic holds for every valid combination, and every global
batch that does not split is refused."""

from hypothesis import given
from hypothesis import strategies as st

from minipar.errors import ConfigError
from minipar.train.config import TrainConfig

sizes = st.integers(min_value=1, max_value=16)


@given(micro=sizes, accum=sizes, dp=sizes)
def test_global_batch_is_always_micro_times_accum_times_dp(micro, accum, dp):
    config = TrainConfig(micro_batch_size=micro, grad_accum_steps=accum, dp=dp)
    assert config.global_batch_size == micro * accum * dp
    again = TrainConfig(micro_batch_size=micro, global_batch_size=config.global_batch_size,
                        dp=dp)
    assert again.grad_accum_steps == accum


@given(micro=sizes, dp=sizes, global_batch=st.integers(min_value=1, max_value=400))
def test_a_global_batch_is_accepted_exactly_when_it_splits(micro, dp, global_batch):
    try:
        config = TrainConfig(micro_batch_size=micro, dp=dp, global_batch_size=global_batch)
    except ConfigError as err:
        assert global_batch % (micro * dp) != 0
        assert err.field == "global_batch_size"
    else:
        assert global_batch % (micro * dp) == 0
        assert config.grad_accum_steps * micro * dp == global_batch
