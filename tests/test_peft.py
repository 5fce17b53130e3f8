"""PEFT (LoRA) with a preserving conversion, in either order (issue 38, point 1).

The preserving adapters are weights PEFT does not own: PEFT trains and saves them only as
``modules_to_save``. ``revify(get_peft_model(...), preserve=...)`` registers them there itself; with
``get_peft_model(revify(..., preserve=...), config)`` the config names them
(``modules_to_save=[*ADAPTER_MODULES]``), and a training step that finds them frozen under LoRA raises.
"""
import json

import pytest
import torch

from revtriton import ADAPTER_MODULES, from_pretrained, revify, train_adapters_only

from test_revify import hf_llama

peft = pytest.importorskip("peft")
TARGETS = ["q_proj", "v_proj"]


def lora_then_revify(seed, mode="meft1"):
    return revify(peft.get_peft_model(hf_llama(seed=seed), peft.LoraConfig(r=4, target_modules=TARGETS)),
                  preserve=mode)


def revify_then_lora(seed, mode="meft1", modules_to_save=(*ADAPTER_MODULES,)):
    config = peft.LoraConfig(r=4, target_modules=TARGETS, modules_to_save=list(modules_to_save) or None)
    return peft.get_peft_model(revify(hf_llama(seed=seed), preserve=mode), config)


ORDERS = {"lora_then_revify": lora_then_revify, "revify_then_lora": revify_then_lora}


def adapter_parameters(model):
    return {n: p for n, p in model.named_parameters() if ".revtriton_adapters." in n}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", ["meft1", "meft2"])
def test_the_adapters_train_beside_lora_and_the_original_copy_stays_frozen(order, mode, seeded):
    model = ORDERS[order](seeded, mode).train()
    adapters = adapter_parameters(model)
    trained = {n for n in adapters if ".modules_to_save.default." in n}
    assert trained and all(adapters[n].requires_grad for n in trained)
    assert all(not p.requires_grad for n, p in adapters.items() if ".original_module." in n)
    assert len(trained) + sum(".original_module." in n for n in adapters) == len(adapters)
    ids = torch.randint(0, 128, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    # The zero-initialised up projections get gradients (their input is not zero): they are the ones used.
    ups = [p for n, p in adapters.items() if n in trained and ".up.weight" in n]
    assert ups and all(p.grad is not None for p in ups) and any(p.grad.abs().sum() > 0 for p in ups)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_" in n)


def test_lora_after_revify_without_the_adapters_in_modules_to_save_raises_on_a_training_step(seeded):
    model = revify_then_lora(seeded, modules_to_save=())
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():  # an evaluation is fine: nothing trains
        model(input_ids=ids)
    with pytest.raises(RuntimeError, match=r"frozen while its PEFT.*revify\(get_peft_model.*modules_to_save"):
        model.train()(input_ids=ids, labels=ids).loss.backward()
    model.eval()(input_ids=ids, labels=ids).loss.backward()  # an eval-mode forward does not train adapters: no check


def test_train_adapters_only_on_a_peft_model_trains_the_copies_not_the_originals(seeded):
    model = train_adapters_only(lora_then_revify(seeded))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n in adapter_parameters(model) if ".modules_to_save.default." in n}


@pytest.mark.parametrize("order", ORDERS)
def test_save_pretrained_holds_every_trainable_parameter_and_loads_onto_a_converted_base(order, seeded, tmp_path):
    from safetensors.torch import load_file

    model = ORDERS[order](seeded)
    with torch.no_grad():  # trained values (the adapters' up projections start at zero)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p), alpha=0.05)
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert len(saved) == sum(p.requires_grad for p in model.parameters())
    assert json.loads((tmp_path / "adapter_config.json").read_text())["modules_to_save"] == list(ADAPTER_MODULES)
    # The documented way back: the base converted as it was trained, then PEFT's loader.
    loaded = peft.PeftModel.from_pretrained(revify(hf_llama(seed=seeded), preserve="meft1"), tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=ids).logits, expected)
    with pytest.raises(ValueError, match=r"PEFT adapter .*peft\.PeftModel\.from_pretrained"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize("order", ORDERS)
def test_a_trainer_run_resumed_from_a_checkpoint_continues_bitwise(order, seeded, tmp_path):
    """10 steps uninterrupted against the same run resumed from its step-5 checkpoint: the
    checkpoint must hold the adapters (they were reset to zero on resume before)."""
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    generator = torch.Generator().manual_seed(seeded)
    rows = [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(0, 128, (20, 16), generator=generator).tolist()]
    runs = []
    for resume in (None, str(tmp_path / "checkpoint-5")):
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=10,
                                 learning_rate=1e-2, report_to=[], save_strategy="steps", save_steps=5,
                                 logging_steps=1, use_cpu=True, disable_tqdm=True, seed=seeded % 2**31)
        trainer = Trainer(model=ORDERS[order](seeded), args=args, train_dataset=rows)
        trainer.train(resume_from_checkpoint=resume)
        runs.append(([e["loss"] for e in trainer.state.log_history if "loss" in e],
                     dict(trainer.model.named_parameters())))
    (losses, params), (resumed_losses, resumed_params) = runs
    assert len(losses) == 10 and resumed_losses == losses
    assert params.keys() == resumed_params.keys()
    assert all(torch.equal(p, resumed_params[n]) for n, p in params.items())
    assert any(p.abs().sum() > 0 for n, p in params.items() if ".modules_to_save.default.up.weight" in n)
