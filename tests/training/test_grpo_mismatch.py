"""eogym_sft/training/grpo_mismatch.py: the sampled log-probabilities each engine hands TRL, paired with the
trained tokens, and the mismatch figures logged from them."""

import math

import pytest
import torch

from eogym_sft.training.grpo_mismatch import GeneratedLogps, SampledLogps, completion_logps, mismatch, token_logps


def test_mismatch_is_the_mean_abs_difference_and_k3_over_the_trained_finite_tokens():
    train = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    rollout = torch.tensor([[-1.5, -2.0, math.nan, -3.0]])
    mask = torch.tensor([[1, 1, 1, 0]])  # the NaN (unrecorded) and the untrained position are left out
    found = mismatch(train, rollout, mask)
    d = torch.tensor([0.5, 0.0])
    assert found["abs_diff"] == pytest.approx(0.25)
    assert found["k3"] == pytest.approx(float((torch.exp(d) - 1 - d).mean()))
    assert mismatch(train, rollout, torch.zeros_like(mask)) is None
    same = mismatch(train, train.clone(), mask)
    assert same == {"abs_diff": 0.0, "k3": 0.0}


def test_token_logps_are_log_softmax_at_the_temperature_with_banned_tokens_out():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 5.0]])
    got = token_logps(logits, [1, 0], 2.0, banned_ids=[2])
    expected = torch.log_softmax(torch.tensor([[0.5, 1.0], [0.0, 0.0]]), -1)[[0, 1], [1, 0]]
    torch.testing.assert_close(got, expected)


def test_sampled_turns_are_paired_with_the_trained_tokens_in_order():
    record = SampledLogps(1.0)
    logits = torch.zeros(2, 4)  # uniform: every pick log(1/4)
    record.add([3, 5], [0, 0], logits, [1, 2])  # both slots start a turn
    record.add([3], [1], logits, [0])
    record.add([3], [0], logits, [2])  # slot 3's second turn
    record.done(3, "a")  # episode a leaves slot 3; episode c takes it
    record.add([3, 5], [0, 1], logits, [1, 1])
    record.done(5, "b")
    record.done(3, "c")
    record.done(None, "d")  # never placed in a slot
    q = torch.tensor(0.25).log().item()  # float32, as recorded
    turns = record.turns()
    assert turns == {"a": [[q, q], [q]], "b": [[q, q]], "c": [[q]], "d": []}
    # the completion: turn 1 (2 tokens), a tool result (2 tokens), turn 2 cut to nothing more than its 1 token
    assert completion_logps([1, 1, 0, 0, 1], turns["a"], [[1, 0], [2]]) == [q, q, 0.0, 0.0, q]
    # a turn that failed mid-way is recorded but not sampled: dropped; a cut last token only shortens the end
    assert completion_logps([1, 1, 0], turns["a"], [[1, 0]]) == [q, q, 0.0]
    lost = completion_logps([1, 0, 1], turns["a"], [[1, 0, 0], [2]])  # lengths disagree: never paired wrongly
    assert math.isnan(lost[0]) and lost[1] == 0.0 and math.isnan(lost[2])
    assert SampledLogps(1.0).turns() == {}


def test_generate_logps_come_from_its_own_forwards():
    """A toy ``generate``: each forward's last logits, the next forward's input the token sampled from them."""

    class Toy(torch.nn.Module):
        def forward(self, input_ids=None):
            logits = torch.zeros(input_ids.shape[0], input_ids.shape[1], 3)
            logits[..., 0] = input_ids.float()  # the logits depend on the last token
            return type("Out", (), {"logits": logits})()

    model = Toy()

    def generate(input_ids):
        seq = input_ids
        for _ in range(2):
            out = model(input_ids=seq if seq is input_ids else seq[:, -1:])
            seq = torch.cat([seq, out.logits[:, -1].argmax(-1, keepdim=True) * 0 + 1], dim=1)  # always token 1
        return seq

    recorder = GeneratedLogps(1.0)
    seq = recorder.wrap(generate, model)(input_ids=torch.tensor([[0], [2]]))
    assert seq.tolist() == [[0, 1, 1], [2, 1, 1]]
    first = torch.log_softmax(torch.tensor([[0.0, 0, 0], [2.0, 0, 0]]), -1)[:, 1]
    second = torch.log_softmax(torch.tensor([[1.0, 0, 0], [1.0, 0, 0]]), -1)[:, 1]
    got = recorder.lists([2, 1])
    assert got[0] == pytest.approx([first[0].item(), second[0].item()]) and got[1] == pytest.approx([first[1].item()])
    assert all(math.isnan(v) for v in recorder.lists([1, 1, 3])[2])  # more rows or steps than recorded: NaN


@pytest.mark.parametrize("engine", ["slots", "trl"])
def test_both_engines_log_a_mismatch_near_zero_on_their_own_episodes(tmp_path, tiny_model_dir, engine):
    """The gold episode (a turn, the crop's tool result, a second turn) and a one-turn answer: each engine's sampled
    log-probabilities line up with the trained tokens and agree with the loss forward's (float32 on CPU, dropout
    off), on both engines' paths through TRL."""
    from helpers import scripted_trainer

    trainer, _ = scripted_trainer(tmp_path, tiny_model_dir, engine, lambda group: group["scripts"], disable_dropout=True)
    example = trainer.train_dataset[0]
    with torch.no_grad():
        batch = trainer._generate_and_score_completions([example, example])
        rollout, mask = batch["sampling_per_token_logps"], batch["completion_mask"] * batch["tool_mask"]
        assert torch.isfinite(rollout[mask.bool()]).all() and (rollout[mask.bool()] < 0).all()
        assert (rollout[~mask.bool()] == 0).all()
        trainer.current_gradient_accumulation_steps = 1  # set by the training loop
        trainer._compute_loss(trainer.model, batch)
    logged = trainer._metrics["train"]
    assert logged["rollout/logp_abs_diff"][-1] < 1e-4 and abs(logged["rollout/k3_kl"][-1]) < 1e-6
