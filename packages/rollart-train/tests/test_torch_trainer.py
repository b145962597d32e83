"""TorchTrainer on the tiny random Qwen2 model, and the tiny-model builder itself."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rollart_core.errors import TrainerError
from rollart_core.types import Trajectory, Turn
from rollart_train import TorchTrainer, TorchTrainerConfig
from rollart_train.tiny import create_tiny_model, is_model_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture
def trainer(tiny_model) -> TorchTrainer:
    """A fresh trainer, for tests that train."""
    return TorchTrainer(TorchTrainerConfig(lr=1e-2), model_path=tiny_model)


@pytest.fixture(scope="module")
def ro_trainer(tiny_model) -> TorchTrainer:
    """A shared trainer for tests that must leave the weights alone (they check that they do)."""
    return TorchTrainer(TorchTrainerConfig(lr=1e-2), model_path=tiny_model)


def make_traj(
    trainer: TorchTrainer,
    turns: list[tuple[list[int], list[int]]],
    reward: float,
    group: str = "g",
    i: int = 0,
    version: int = 0,
) -> Trajectory:
    """A trajectory whose behaviour logprobs are the trainer's own (so every ratio is 1)."""
    built: list[Turn] = []
    prefix: list[int] = []
    for ctx, out in turns:
        prefix = prefix + ctx + out
        lps = trainer.logprobs(prefix)[-len(out) :] if out else []
        built.append(
            Turn(
                context_ids=list(ctx),
                output_ids=list(out),
                output_logprobs=lps,
                output_versions=[version] * len(out),
            )
        )
    return Trajectory(
        traj_id=f"{group}-{i}",
        task="t",
        env_id="e",
        group_id=group,
        seed=i,
        start_version=version,
        turns=built,
        reward=reward,
        fate=None,
        terminated=True,
    )


def gen_logprob_sum(trainer: TorchTrainer, t: Trajectory) -> float:
    lp = trainer.logprobs(t.token_ids())
    mask = t.loss_mask()[1:]
    return sum(x for x, m in zip(lp, mask, strict=True) if m)


def reference_logprobs(model_dir: Path | str, ids: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def make_group_batch(trainer, tokenizer) -> list[Trajectory]:
    ctx = encode(tokenizer, "<|im_start|>user\nreach the goal\n<|im_end|>\n<|im_start|>assistant\n")
    outs = ["right down<|im_end|>", "left<|im_end|>", "up up up<|im_end|>", "answer 42 plus<|im_end|>"]
    rewards = [1.0, 0.5, 0.0, -1.0]
    return [
        make_traj(trainer, [(ctx, encode(tokenizer, o))], r, i=i)
        for i, (o, r) in enumerate(zip(outs, rewards, strict=True))
    ]


# logprobs ---------------------------------------------------------------------------------------


def test_logprobs_match_independent_hf_forward(ro_trainer, tiny_model, tokenizer) -> None:
    trainer = ro_trainer
    ids = encode(tokenizer, "<|im_start|>user\nthe agent moves left on a frozen lake<|im_end|>")
    got = trainer.logprobs(ids)
    exp = reference_logprobs(tiny_model, ids)
    assert len(got) == len(ids) - 1
    for a, b in zip(got, exp, strict=True):
        assert a == pytest.approx(b, abs=1e-4)
    assert trainer.model.training  # logprobs() restores train mode


def test_logprobs_do_not_depend_on_later_tokens(ro_trainer) -> None:
    trainer = ro_trainer
    ids = [5, 17, 99, 3, 250, 7]
    full = trainer.logprobs(ids)
    prefix = trainer.logprobs(ids[:4])
    for a, b in zip(prefix, full[:3], strict=True):
        assert a == pytest.approx(b, abs=1e-5)


# train_step -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stepped(tiny_model, tokenizer):
    """One train step on a group of four; records what the tests below compare against."""
    trainer = TorchTrainer(TorchTrainerConfig(lr=1e-2), model_path=tiny_model)
    batch = make_group_batch(trainer, tokenizer)
    weights_before = {n: w.clone() for n, w in trainer.named_weights()}
    lp_before = [gen_logprob_sum(trainer, t) for t in batch]
    version_before = trainer.version
    metrics = trainer.train_step(batch)
    lp_after = [gen_logprob_sum(trainer, t) for t in batch]
    return {
        "trainer": trainer,
        "batch": batch,
        "weights_before": weights_before,
        "metrics": metrics,
        "lp_before": lp_before,
        "lp_after": lp_after,
        "version_before": version_before,
    }


def test_train_step_increments_version(stepped) -> None:
    assert stepped["version_before"] == 0
    assert stepped["trainer"].version == 1
    assert stepped["metrics"]["version"] == 1.0


def test_train_step_returns_finite_metrics(stepped) -> None:
    metrics, batch = stepped["metrics"], stepped["batch"]
    for k in ("loss", "clip_frac", "approx_kl", "grad_norm", "reward_mean", "train_tokens", "train_s"):
        assert k in metrics
    for k, v in metrics.items():
        assert isinstance(v, float), k
        assert math.isfinite(v), k
    assert metrics["train_tokens"] == float(sum(len(t.output_ids) for tr in batch for t in tr.turns))
    assert metrics["reward_mean"] == pytest.approx(sum(t.reward for t in batch) / len(batch))
    # behaviour logprobs came from the trainer itself: ratio 1, nothing clipped, no KL
    assert metrics["clip_frac"] == 0.0
    assert abs(metrics["approx_kl"]) < 1e-5
    assert metrics["grad_norm"] > 0
    # ratio 1 ⇒ loss = -mean over tokens of the advantage (GRPO advantages computed here)
    rewards = [t.reward for t in batch]
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    adv = [(r - mean) / (std + 1e-6) for r in rewards]
    n = [t.num_generated() for t in batch]
    assert metrics["loss"] == pytest.approx(
        -sum(a * k for a, k in zip(adv, n, strict=True)) / sum(n), abs=1e-5
    )


def test_train_step_changes_weights(stepped) -> None:
    before = stepped["weights_before"]
    after = dict(stepped["trainer"].named_weights())
    assert set(before) == set(after)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert "lm_head.weight" in changed
    assert len(changed) >= 0.9 * len(before)


def test_train_step_moves_logprobs_in_policy_gradient_direction(stepped) -> None:
    batch, before, after = stepped["batch"], stepped["lp_before"], stepped["lp_after"]
    best = max(range(len(batch)), key=lambda i: batch[i].reward)
    worst = min(range(len(batch)), key=lambda i: batch[i].reward)
    assert after[best] > before[best]
    assert after[worst] < before[worst]


def test_train_step_mixed_lengths_and_multi_turn(trainer, tokenizer) -> None:
    # different lengths (right padding), two turns, several micro-batches: ratio must still be 1
    trainer.config = trainer.config.model_copy(update={"micro_batch_size": 2})
    c1 = encode(tokenizer, "<|im_start|>user\nstart<|im_end|>\n<|im_start|>assistant\n")
    c2 = encode(
        tokenizer, "<|im_end|>\n<|im_start|>user\nstep reward done<|im_end|>\n<|im_start|>assistant\n"
    )
    batch = [
        make_traj(trainer, [(c1, encode(tokenizer, "left")), (c2, encode(tokenizer, "down down"))], 1.0, i=0),
        make_traj(trainer, [(c1, encode(tokenizer, "up"))], 0.0, i=1),
        make_traj(
            trainer,
            [(c1, encode(tokenizer, "right right right")), (c2, encode(tokenizer, "R"))],
            0.0,
            group="h",
            i=2,
        ),
        make_traj(trainer, [(c1, encode(tokenizer, "the goal"))], 1.0, group="h", i=3),
        make_traj(trainer, [(c1, encode(tokenizer, "x"))], 0.5, group="h", i=4),
    ]
    metrics = trainer.train_step(batch)
    assert abs(metrics["approx_kl"]) < 1e-5
    assert metrics["clip_frac"] == 0.0
    assert metrics["train_tokens"] == float(sum(t.num_generated() for t in batch))
    assert trainer.version == 1


def test_adaptive_entropy_control(tiny_model, tokenizer, tmp_path) -> None:
    """Under ``entropy_target`` the coefficient climbs while the entropy is below the target, falls
    once above, is what the loss uses, and is checkpointed."""
    base = {"lr": 1e-2, "entropy_coef": 0.0}
    fixed = TorchTrainer(TorchTrainerConfig(**base), model_path=tiny_model)
    # a target above any entropy reachable here: the coefficient climbs every step, to the cap
    adaptive = TorchTrainer(
        TorchTrainerConfig(**base, entropy_target=100.0, entropy_coef_step=0.5, entropy_coef_max=1.0),
        model_path=tiny_model,
    )
    coefs = []
    for tr in (fixed, adaptive):
        for _ in range(4):
            m = tr.train_step(make_group_batch(tr, tokenizer))
            # the loss is the policy-gradient loss minus the coefficient in use times the entropy
            assert m["loss"] == pytest.approx(
                m["pg_loss"] - m["entropy_coef"] * m["entropy"], rel=1e-4, abs=1e-6
            )
            if tr is adaptive:
                coefs.append(m["entropy_coef"])
            else:
                assert m["entropy_coef"] == 0.0
    assert coefs == [0.0, 0.5, 1.0, 1.0]  # the coefficient used in each step
    adaptive.save(tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "rollart_trainer.json").read_text())["entropy_coef"] == 1.0
    # resumed with a target below any entropy: starts from the saved 1.0 and steps down to the
    # floor, entropy_coef
    low = TorchTrainerConfig(
        **{**base, "entropy_coef": 0.25},
        entropy_target=1e-6,
        entropy_coef_step=0.5,
        entropy_coef_max=1.0,
        resume_from=str(tmp_path / "ckpt"),
    )
    resumed = TorchTrainer(low, model_path=tiny_model)
    used = [resumed.train_step(make_group_batch(resumed, tokenizer))["entropy_coef"] for _ in range(3)]
    assert used == [1.0, 0.5, 0.25]
    with pytest.raises(ValueError, match="entropy_coef_max"):
        TorchTrainerConfig(entropy_coef=0.5, entropy_target=0.1, entropy_coef_max=0.2)


def test_train_step_empty_batch_raises(ro_trainer) -> None:
    trainer = ro_trainer
    with pytest.raises(TrainerError):
        trainer.train_step([])
    assert trainer.version == 0


def test_train_step_without_generated_tokens_raises(ro_trainer, tokenizer) -> None:
    trainer = ro_trainer
    before = {n: w.clone() for n, w in trainer.named_weights()}
    batch = [
        make_traj(trainer, [(encode(tokenizer, "hello there"), [])], r, i=i) for i, r in enumerate([0.0, 1.0])
    ]
    with pytest.raises(TrainerError):
        trainer.train_step(batch)
    assert trainer.version == 0
    assert all(torch.equal(before[n], w) for n, w in trainer.named_weights())


# save / reload ----------------------------------------------------------------------------------


def test_save_writes_reloadable_checkpoint(stepped, tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = stepped["trainer"]  # trained one step, so the saved weights differ from the initial ones
    out = tmp_path / "ckpt"
    trainer.save(out)
    assert (out / "model.safetensors").is_file()
    assert (out / "tokenizer.json").is_file()
    assert json.loads((out / "rollart_trainer.json").read_text())["version"] == 1
    assert is_model_dir(out)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    mine = trainer.model.state_dict()
    theirs = reloaded.state_dict()
    assert set(mine) == set(theirs)
    for n in mine:
        assert theirs[n].dtype == mine[n].dtype, n
        assert torch.equal(theirs[n], mine[n]), n
    initial = AutoModelForCausalLM.from_pretrained(trainer.model_path, dtype=torch.float32).state_dict()
    assert not torch.equal(initial["lm_head.weight"], theirs["lm_head.weight"])
    # the tokenizer travels with it
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.convert_tokens_to_ids("<|im_end|>") == reloaded.config.eos_token_id


# tiny model -------------------------------------------------------------------------------------


def test_tiny_model_config_and_tokenizer(tiny_model, tokenizer) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(tiny_model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert head_dim == 64
    assert cfg.hidden_size // cfg.num_attention_heads == 64
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.out_features == cfg.num_attention_heads * 64
    assert attn.k_proj.out_features == cfg.num_key_value_heads * 64
    assert cfg.vocab_size % 64 == 0 and cfg.vocab_size >= len(tokenizer)
    for special in ("<|im_start|>", "<|im_end|>"):
        assert special in tokenizer.all_special_tokens
        ids = encode(tokenizer, special)
        assert len(ids) == 1  # one token, not split into bytes
        assert tokenizer.decode(ids) == special
    assert tokenizer.eos_token == "<|im_end|>"
    assert cfg.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_is_model_dir(tiny_model, tmp_path) -> None:
    assert is_model_dir(tiny_model)
    assert is_model_dir(str(tiny_model))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert not is_model_dir(empty)
    assert not is_model_dir(tmp_path / "does-not-exist")
    # config + tokenizer without weights is not a model dir
    partial = tmp_path / "partial"
    partial.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (partial / f).write_text((tiny_model / f).read_text())
    assert not is_model_dir(partial)


def test_create_tiny_model_rejects_wrong_head_dim(tmp_path) -> None:
    with pytest.raises(ValueError, match="head_dim"):
        create_tiny_model(tmp_path / "bad", hidden_size=256, num_heads=8)
