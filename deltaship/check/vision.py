"""Export-time verification of the image side: image + text prompts through the bundle's multimodal parts
against transformers' Qwen3_5ForConditionalGeneration (greedy tokens and logits), recorded in the manifest's
`vision.verification`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from deltaship.errors import DeltashipError
from deltaship.models.families import family_of_architecture
from deltaship.models.presets import get_preset
from deltaship.models.vision import preprocess_image, smart_resize
from deltaship.targets import open_bundle, open_multimodal, tolerance
from deltaship.targets.tolerances import fp32_bar


def test_images(pre) -> list[tuple[int, int]]:
    """(height, width) of the fixed test images: square, wide with an odd merged width, tall; in pixels that
    smart_resize keeps (multiples of patch x merge within the preprocessor's limits)."""

    f = pre.factor
    sizes = [(2 * f, 2 * f), (2 * f, 3 * f), (5 * f, 3 * f)]
    return [smart_resize(h, w, f, pre.min_pixels, pre.max_pixels) for h, w in sizes]


def verify_vision(bundle: Path, manifest: dict[str, Any], source, steps: int = 8, ctx=None) -> dict[str, Any]:
    """Each test image (seeded noise) in `<|vision_start|><|image_pad|><|vision_end|>` between a few text
    tokens, one prompt per image, generated greedily by the bundle and by transformers (cached generate).
    An fp16 bundle is checked against the matched reference: transformers in fp32 with every weight rounded to
    fp16 as the bundle stores it (the whole tower; the text weights the export's plan keeps in the model dtype),
    at the target's fp16 tolerance row."""
    import torch  # lazy: torch
    from PIL import Image

    from deltaship.check.verify import bundle_not_finite, reference_not_finite  # lazy: torch
    from deltaship.oracle.reference import quiet_third_party  # lazy: torch

    quiet_third_party()
    tol = tolerance(manifest["target"], manifest["precision"])
    mm = open_multimodal(open_bundle(bundle, check_hashes=False))
    sp = mm.spec
    model = reference(source, torch.float32)
    if manifest["precision"] == "fp16":
        round_to_fp16(model, ctx, source.spec.tie_word_embeddings)
    model.generation_config.eos_token_id = None  # every step, an EOS token included
    rng = np.random.default_rng(0)
    text = [i for i in range(1, 64) if i not in (sp.image_token_id, sp.video_token_id)][:4]
    rows, cases = [], []
    for h, w in test_images(mm.pre):
        im = preprocess_image(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)), mm.pre)
        prompt = text[:2] + [sp.vision_start_token_id, sp.image_token_id, sp.vision_end_token_id] + text[2:]
        gen = mm.generate(prompt, [im], steps, keep_logits=True, stop_at_eos=False)
        ids = torch.tensor([gen.input_ids])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                pixel_values=torch.from_numpy(im.patches),
                image_grid_thw=torch.tensor([im.grid]),
                mm_token_type_ids=(ids == sp.image_token_id).int(),
                max_new_tokens=steps,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        ref = out.sequences[0, ids.shape[1] :].tolist()
        ref_logits = torch.cat(out.logits).float().numpy()
        where = f"the {h}x{w} test image with {len(ref)} greedy steps"
        if (err := reference_not_finite(ref_logits, where)) is not None:
            raise err
        got = np.stack(gen.logits)
        names = ["the prefill"] + [f"decode step {i}" for i in range(1, len(got))]
        if (err := bundle_not_finite(got, where, names, manifest["precision"])) is not None:
            raise err
        cases.append((gen.input_ids, ref, im, ref_logits))
        diff = float(np.abs(got - ref_logits).max())
        rows.append(
            {
                "image": [h, w],
                "grid_thw": list(im.grid),
                "image_tokens": im.tokens(sp.spatial_merge_size),
                "max_abs_logit_diff": diff,
                "max_rel_logit_diff": diff / float(ref_logits.std()),
                "greedy_agreement": float(np.mean([a == b for a, b in zip(gen.output_ids, ref)])),
            }
        )
    worst = max(r["max_rel_logit_diff"] for r in rows)
    agree = min(r["greedy_agreement"] for r in rows)
    bar = fp32_bar(tol.max_rel_logit_diff, None)
    if worst > bar.value and manifest["precision"] == "fp32":  # only then: the common path pays nothing
        del model
        bar = fp32_bar(tol.max_rel_logit_diff, fp32_reach(source, cases, sp.image_token_id))
    ok = worst <= bar.value and agree >= tol.min_greedy_agreement
    import transformers  # lazy: transformers

    record = {
        "status": "passed" if ok else "failed",
        "reference": f"transformers {transformers.__version__} Qwen3_5ForConditionalGeneration, fp32"
        + (", weights rounded to fp16 as the bundle stores them" if manifest["precision"] == "fp16" else ""),
        "steps": steps,
        "images": rows,
        "max_rel_logit_diff": worst,
        "greedy_agreement": agree,
        "tolerance": tol.__dict__,
    }
    if bar.reach is not None:
        record["bar"] = bar.as_dict()
    if not ok and tol.fails_export:
        raise DeltashipError(
            f"vision verification failed: image + text logits differ from transformers by {worst:.3g} of the "
            f"logit std against {bar.describe()} (greedy agreement {agree:.3f}, at least {tol.min_greedy_agreement} "
            "needed); nothing was written",
            "this is a deltaship bug: please report it with the model's config.json",
        )
    return record


def reference(source, dtype):
    """transformers' Qwen3_5ForConditionalGeneration with the source's weights, in `dtype`, eval."""
    import torch  # lazy: torch
    from transformers import Qwen3_5ForConditionalGeneration

    if source.path is not None:
        return Qwen3_5ForConditionalGeneration.from_pretrained(source.path, dtype=dtype).eval()
    return preset_reference(source).to(dtype) if dtype != torch.float32 else preset_reference(source)


def fp32_reach(source, cases, image_token_id: int) -> float:
    """What fp32 itself can reach on this checkpoint: the float32 reference's generated logits (cases: input ids,
    its greedy tokens, the image, its logits [steps, vocab]) against transformers in float64 on the same tokens,
    measured as verify_vision measures the bundle (max |difference| over the logit std)."""
    import torch  # lazy: torch

    hi = reference(source, torch.float64)
    hi.generation_config.eos_token_id = None
    worst = 0.0
    with torch.no_grad():
        for input_ids, toks, im, ref_logits in cases:
            # generated as the float32 reference was (cached), each step forced to its token: a forward pass over
            # the whole sequence would take a generated image token for a placeholder
            ids, p = torch.tensor([input_ids]), len(input_ids)
            out = hi.generate(
                input_ids=ids,
                pixel_values=torch.from_numpy(im.patches).double(),
                image_grid_thw=torch.tensor([im.grid]),
                mm_token_type_ids=(ids == image_token_id).int(),
                max_new_tokens=len(toks),
                do_sample=False,
                prefix_allowed_tokens_fn=lambda _, seq, toks=toks, p=p: [toks[len(seq) - p]],
                output_logits=True,
                return_dict_in_generate=True,
            )
            exact = torch.cat(out.logits).numpy()
            worst = max(worst, float(np.abs(ref_logits - exact).max()) / float(exact.std()))
    del hi
    return worst


def round_to_fp16(model, ctx, tied: bool) -> None:
    """Round the reference's weights as an fp16 bundle stores them: every vision tower tensor, and each text
    tensor whose weight-plan recipe is in the model dtype (ctx.plan; all of them without a plan)."""
    import torch  # lazy: torch

    half = None
    if ctx is not None and getattr(ctx, "plan", None) is not None:
        half = {s for r in ctx.plan.recipes.values() if r.dtype == "model" for s in r.sources}
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            if name.startswith("model.language_model."):
                src = "model." + name.removeprefix("model.language_model.")
            elif name == "lm_head.weight" and tied:
                src = "model.embed_tokens.weight"
            else:
                src = name
            if name.startswith("model.visual.") or half is None or src in half:
                p.data = p.data.half().float()


def preset_reference(source):
    """transformers' Qwen3_5ForConditionalGeneration holding a published-shape preset's random weights (text,
    as RandomWeights reads them, and the vision tower beside them), fp32."""
    import torch  # lazy: torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from transformers.models.qwen3_5.modeling_qwen3_5 import (  # lazy: transformers
        Qwen3_5TextRotaryEmbedding,
        Qwen3_5VisionRotaryEmbedding,
    )

    mm = get_preset(source.name).multimodal_config()
    spec = source.spec
    vision = {k: v for k, v in mm["vision_config"].items() if k != "model_type"}
    cfg = Qwen3_5Config(
        text_config=family_of_architecture(spec.architecture).hf_config(spec),
        vision_config=vision,
        tie_word_embeddings=spec.tie_word_embeddings,
        **{k: mm[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")},
    )
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(cfg)
    model.to_empty(device="cpu")
    state = {}
    for name in source.weights.names():
        if name.startswith("mtp."):
            continue
        key = "model.language_model." + name.removeprefix("model.") if name.startswith("model.") else name
        state[key] = torch.from_numpy(np.array(source.weights.read(name)))
    for sf in source.weights.files.values():
        state |= {name: torch.from_numpy(sf.read(name)) for name in sf.entries}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and spec.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"reference model weights do not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.model.language_model.embed_tokens.weight
    # rotary inverse frequencies are buffers, left empty by to_empty: build those two modules afresh
    model.model.language_model.rotary_emb = Qwen3_5TextRotaryEmbedding(cfg.text_config)
    model.model.visual.rotary_pos_emb = Qwen3_5VisionRotaryEmbedding(cfg.vision_config)
    return model.float().eval()
