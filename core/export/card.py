"""The model card of every export: README.md in the Hugging Face Hub's format, written inside the atomic export
(core/export/folder.py) so it is never half-written, and updated in place only by a whole-file replace.

    ---                                   front matter (YAML): license (only when config.json's pretrained_cfg has
    library_name: timm                    one), library_name, pipeline_tag, tags (the task, the method, mimpipe),
    ...                                   datasets (Hub ids from the shards' index.json when known), base_model (an
                                          `hf-hub:` init)
    ---
    # title, one line of summary         the model as built, not timm's name for it (card_names.py)
    ## Use it in timm                    two lines (the export's folder, or its Hub repo once pushed)
    ## Model                             architecture, parameters, classes / segmentation head, preprocessing
    ## Training                          objective, init (and the method it was made by), data, steps, global batch
    ## Evaluation                        `mimpipe evaluate`'s table, only once one was run (`update_card_evaluation`)
    ## Monitors                          metrics.jsonl's last values at the exported step
    ## Recipe                            the whole resolved recipe (the run's config.yaml)
    ## Files, ## License                 the license config.json names, or that none is set

Everything is read from what the export holds (config.json, the manifest and its recipe) plus `RunFacts`: what only
the run's shards, hand-off record and metrics.jsonl know, gathered by `run_facts` when the export is written.

The license has one source, config.json's `pretrained_cfg.license` (core/export/folder.py writes it only when the
export is given one): the front matter's `license:` and the License section say what it says. When none is set, the
card says so in its body only, never in a YAML comment: huggingface_hub's `ModelCard.load(...).save(...)` writes the
metadata back from what it parsed, which drops comments, while the body is kept as it is.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path

import yaml

from core.export.card_facts import MONITORS, DataSource, RunFacts
from core.export.card_names import METHOD_NAMES, PRETRAINING, init_origin, model_name
from core.export.manifest import MANIFEST_NAME
from core.export.read import read_json
from core.launch.ckpt_files import fsync_path
from core.recipe.tree import flatten
from data.quickstart import SYNTHETIC_WARNING

CARD_NAME = "README.md"
"""The card's file name inside an export folder (the Hub shows a repo's README.md as its card)."""
EVALUATION = "Evaluation"
USE = "Use it in timm"
ORDER = ("Use it in timm", "Model", "Training", EVALUATION, "Monitors", "Recipe", "Files", "License")
"""The body's sections in order (`update_card_evaluation` puts its section in its place)."""


def render_card(config: dict, manifest: dict, *, location: str, files: list[str], facts: RunFacts | None = None) -> str:
    """The card's text.

    Args:
        config: The export's config.json (architecture, model_args, pretrained_cfg, num_classes).
        manifest: Its mimpipe.json.
        location: What `timm.create_model` is given: `local-dir:PATH`, or `hf-hub:ORG/NAME` once pushed.
        files: The export's file names, for the Files section.
        facts: What the run's shards and metrics.jsonl say (None: what the export holds alone).
    """
    run = manifest.get("source_manifest") or manifest  # a converted export of ours tells its own run
    recipe = manifest.get("config") or run.get("config") or {}
    sections = {
        USE: use_section(location),
        "Model": model_section(config, manifest),
        "Training": training_section(manifest, run, recipe, facts),
        "Monitors": monitors_section(manifest, facts),
        "Recipe": recipe_section(recipe),
        "Files": files_section(files),
        "License": license_section(config),
    }
    body = [f"# {title(config, manifest)}", "", summary(manifest)]
    for name in ORDER:
        if sections.get(name):
            body += ["", f"## {name}", "", sections[name]]
    return front_matter(config, manifest, recipe, facts) + "\n".join(body) + "\n"


LICENSE_TEXT = (
    "Not set: neither the front matter above (`license:`) nor config.json (`pretrained_cfg.license`) names one. Set "
    "the same in both (e.g. `apache-2.0`, `mit`, `cc-by-nc-4.0`, or `other` with `license_name` and `license_link`) "
    "before publishing."
)
TERMS = "The weights carry the terms of the data they were trained on, and of the weights they started from."
FILES = {
    "config.json": "timm's configuration: architecture, its arguments, preprocessing",
    "model.safetensors": "the weights (safetensors, no pickle)",
    "mimpipe.json": "how they were made: method, step, source, the whole recipe",
    "seg_head.safetensors": "the segmentation neck and head (rebuilt from mimpipe.json's `segmentation`)",
    CARD_NAME: "this card",
}


def task(config: dict, manifest: dict) -> str:
    """The Hub's pipeline tag: what the exported model does."""
    method = manifest.get("method")
    if method == "segmentation":
        return "image-segmentation"
    if method not in PRETRAINING and config.get("num_classes"):
        return "image-classification"
    return "image-feature-extraction"


def license_of(config: dict) -> str | None:
    """The export's license: config.json's `pretrained_cfg.license` (None: not set)."""
    return (config.get("pretrained_cfg") or {}).get("license") or None


def front_matter(config: dict, manifest: dict, recipe: dict, facts: RunFacts | None) -> str:
    """The YAML block between `---` lines; `license:` only when config.json names one."""
    kind = task(config, manifest)
    license_id = license_of(config)
    meta = {"license": license_id} if license_id else {}
    meta |= {"library_name": "timm", "pipeline_tag": kind, "tags": [kind, *method_tags(manifest), "mimpipe"]}
    convert = manifest.get("method") == "convert"
    init = manifest.get("source") if convert else (recipe.get("model") or {}).get("init")
    if isinstance(init, str) and init.startswith("hf-hub:"):
        meta["base_model"] = init.removeprefix("hf-hub:").partition("@")[0]
    datasets = list(dict.fromkeys(s.dataset for s in (facts.data if facts else []) if s.dataset))
    if datasets:
        meta["datasets"] = datasets
    return f"---\n{yaml.safe_dump(meta, sort_keys=False)}---\n\n"


def method_tags(manifest: dict) -> list[str]:
    """The method's tags: the pretraining objective, distillation, the converted checkpoint's family."""
    method, fmt = str(manifest.get("method") or ""), manifest.get("checkpoint_format")
    run_method = (manifest.get("source_manifest") or {}).get("method")
    if method in PRETRAINING:
        return [method]
    if method.startswith("deit-distill"):
        return ["deit", "distillation"]
    if method == "convert":
        family = {"mae-pretrain": "mae", "mae-finetune": "mae", "deit-distilled": "deit"}.get(fmt)
        return [tag for tag in (family, run_method if run_method in PRETRAINING else None) if tag]
    return []


def title(config: dict, manifest: dict) -> str:
    arch, method = model_name(config), manifest.get("method")
    num_classes = config.get("num_classes") or 0
    if method in PRETRAINING:
        return f"{arch} pretrained with {METHOD_NAMES[method]}"
    if method == "segmentation":
        seg = manifest.get("segmentation") or {}
        head, num_classes = seg.get("head", "?"), seg.get("num_classes")
        return f"{arch} fine-tuned for semantic segmentation ({head} head, {num_classes} classes)"
    if method == "convert":
        return f"{arch} converted from a {manifest.get('checkpoint_format', '?')} checkpoint"
    if method == "finetune" or str(method).startswith("deit-distill"):
        how = {"linear_probe": "linear probe", "finetune": "fine-tuned"}.get(manifest.get("mode"), "fine-tuned")
        how = "distilled (DeiT)" if str(method).startswith("deit-distill") else how
        return f"{arch} {how} for image classification ({num_classes} classes)"
    return f"{arch} exported by mimpipe"


def summary(manifest: dict) -> str:
    made = {"convert": "`python -m finetune convert`", **dict.fromkeys(PRETRAINING, "`python -m pretrain`")}
    by = made.get(manifest.get("method"), "`python -m finetune`" if manifest.get("config") else "mimpipe")
    step = f" at step {manifest['step']:,}" if isinstance(manifest.get("step"), int) else ""
    created = f" on {manifest['created'][:10]}" if manifest.get("created") else ""
    return f"A timm model written by mimpipe ({by}){step}{created}, in timm's Hugging Face layout."


def use_section(location: str) -> str:
    init = location.removeprefix("local-dir:")
    return "\n".join([
        "```python",
        "import timm",
        f'model = timm.create_model("{location}", pretrained=True)',
        "```",
        "",
        f"Fine-tune or probe it with mimpipe: `model.init: {init}` in a fine-tuning recipe.",
    ])  # fmt: skip


def model_section(config: dict, manifest: dict) -> str:
    args = ", ".join(f"{k}={_value(v)}" for k, v in (config.get("model_args") or {}).items())
    lines = [f"- Architecture: `{config.get('architecture')}` (timm)" + (f", built with {args}" if args else "")]
    if manifest.get("num_params"):
        lines.append(f"- Parameters: {manifest['num_params'] / 1e6:.2f} M in {manifest['num_tensors']} tensors")
    classes, num_classes = manifest.get("classes") or [], config.get("num_classes") or 0
    seg = manifest.get("segmentation")
    if seg:
        aux = ", auxiliary FCN head" if seg.get("aux") else ""
        head = f"{seg.get('head')} (channels {seg.get('channels')}{aux})"
        lines.append(f"- Segmentation head: {head}; its weights are `{seg.get('head_file')}`, timm loads the encoder")
        lines.append(f"- Classes: {seg.get('num_classes')}" + (f": {_names(classes)}" if classes else ""))
    elif num_classes:
        lines.append(f"- Classifier: {num_classes} classes" + (f": {_names(classes)}" if classes else ""))
    else:
        pool = f" (pooling hint for fine-tuning: {manifest['pooling_hint']})" if manifest.get("pooling_hint") else ""
        lines.append(f"- Output: features, no classifier{pool}")
    cfg = config.get("pretrained_cfg") or {}
    prep = [f"{k} {cfg[k]}" for k in ("input_size", "mean", "std", "interpolation", "crop_pct") if k in cfg]
    if prep:
        lines.append(f"- Preprocessing (config.json): {', '.join(prep)}")
    return "\n".join(lines)


def training_section(manifest: dict, run: dict, recipe: dict, facts: RunFacts | None) -> str:
    lines = []
    if manifest.get("method") == "convert":
        dropped = manifest.get("not_exported") or []
        left = f"; {len(dropped)} tensors left out (decoder, mask token, ...)" if dropped else ""
        fmt = manifest.get("checkpoint_format")
        lines.append(f"- Converted from `{manifest.get('source')}` (a {fmt} checkpoint){left}")
    if not recipe:
        return "\n".join(lines)
    if manifest.get("synthetic_data") or run.get("synthetic_data"):
        lines.append(f"- **Trained on {SYNTHETIC_WARNING}** (the quickstart's fallback without Fashion-MNIST)")
    objective = recipe.get("objective") or {}
    settings = ", ".join(f"{k} {_value(v)}" for k, v in flatten(objective).items() if k != "kind")
    lines.append(f"- Objective: `{objective.get('kind')}`" + (f" ({settings})" if settings else ""))
    if manifest.get("encoder"):  # an objective with an EMA teacher: which of its two encoders this is
        note = (
            "; timm's pre-norm blocks (the data2vec 2.0 paper's are post-LN)"
            if manifest["method"] == "data2vec2"
            else ""
        )
        lines.append(f"- Encoder: the {manifest['encoder']} of the student and its EMA teacher{note}")
    init = (recipe.get("model") or {}).get("init")
    origin = init_origin(facts.init) if facts and facts.init and facts.init.spec == init else ""
    started = f"- Started from: `{init}`" + (f" ({origin})" if origin else "")
    lines.append(started if init else "- Started from: random initialisation")
    for source in facts.data if facts else _recipe_sources(recipe):
        lines.append(f"- Data ({source.role}): {_describe(source)}")
    batch, step = (recipe.get("data") or {}).get("global_batch_size"), run.get("step")
    total = f" of {facts.total_steps:,}" if facts and facts.total_steps else ""
    if isinstance(step, int) and batch:
        best = " (the best evaluation so far)" if run.get("metrics") and run.get("method") != "convert" else ""
        lines.append(
            f"- Steps: exported at optimizer step {step:,}{total}{best}, global batch {batch:,} "
            f"({step * batch:,} samples seen)"
        )
    return "\n".join(lines)


def monitors_section(manifest: dict, facts: RunFacts | None) -> str:
    """The monitors' last values, the exported weights' own evaluation (the manifest's `metrics`) taking precedence."""
    values = dict(facts.monitors) if facts else {}
    step = manifest.get("step")
    for key, value in (manifest.get("metrics") or {}).items():
        if isinstance(step, int) and isinstance(value, int | float) and any(key.startswith(m) for m in MONITORS):
            values[key] = (step, float(value))
    if not values:
        return ""
    rows = [f"| {key} | {value:.4g} | {at:,} |" for key, (at, value) in sorted(values.items(), key=_monitor_order)]
    head = "The last values logged at or before the exported step (the run's metrics.jsonl):"
    return "\n".join([head, "", "| monitor | value | step |", "|---|---|---|", *rows])


def recipe_section(recipe: dict) -> str:
    if not recipe:
        return ""
    text = yaml.safe_dump(recipe, sort_keys=False).rstrip()
    return "\n".join([
        "The whole resolved recipe (the run's `config.yaml`); `./launch.sh config.yaml run_dir=DIR` trains it again.",
        "",
        "<details>",
        "<summary>config.yaml</summary>",
        "",
        "```yaml",
        text,
        "```",
        "",
        "</details>",
    ])  # fmt: skip


def license_section(config: dict) -> str:
    license_id = license_of(config)
    if not license_id:
        return f"{LICENSE_TEXT} {TERMS}"
    return f"`{license_id}` (the front matter's `license:`, as config.json's `pretrained_cfg.license`). {TERMS}"


def files_section(files: list[str]) -> str:
    return "\n".join(f"- `{name}`: {FILES[name]}" if name in FILES else f"- `{name}`" for name in sorted(files))


def _recipe_sources(recipe: dict) -> list[DataSource]:
    """The data the recipe names, as written (nothing read)."""
    data = recipe.get("data") or {}
    train = data.get("train")
    if isinstance(train, list) and train and isinstance(train[0], dict):  # a mixture
        sources = [DataSource(f"train (weight {s.get('weight', 1):g})", str(s.get("shards"))) for s in train]
    else:
        sources = [DataSource("train", str(train))] if train else []
    return sources + ([DataSource("val", str(data["val"]))] if data.get("val") else [])


def _describe(source: DataSource) -> str:
    facts = [f"{source.num_shards:,} shards" if source.num_shards else None]
    facts.append(f"{source.num_samples:,} samples" if source.num_samples else None)
    facts += [source.source, f"Hub dataset `{source.dataset}`" if source.dataset else None]
    known = ", ".join(fact for fact in facts if fact)
    return f"`{source.spec}`" + (f": {known}" if known else "")


def _names(classes: list[str], limit: int = 20) -> str:
    shown = ", ".join(str(c) for c in classes[:limit])
    return shown + (f", ... ({len(classes)} in all)" if len(classes) > limit else "")


def _monitor_order(item: tuple[str, tuple[int, float]]) -> tuple[int, list]:
    """MONITORS' order, then the keys of a prefix in natural order (fewshot/top1_5shot before fewshot/top1_10shot)."""
    key = item[0]
    natural = [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]
    return next((i for i, m in enumerate(MONITORS) if key.startswith(m)), len(MONITORS)), natural


def _value(value: object) -> str:
    """A recipe or config value as YAML writes it (true, null, [16, 16])."""
    return value if isinstance(value, str) else json.dumps(value)


def write_card(folder: Path, *, location: str, facts: RunFacts | None = None) -> Path:
    """Render the card of the export being written in `folder` (its config.json and manifest already there)."""
    files = sorted({p.name for p in folder.iterdir() if p.is_file()} | {CARD_NAME})
    text = render_card(
        read_json(folder / "config.json"), read_json(folder / MANIFEST_NAME), location=location, files=files,
        facts=facts,
    )  # fmt: skip
    (folder / CARD_NAME).write_text(text)
    return folder / CARD_NAME


def update_card_evaluation(export_dir: str | Path, table_markdown: str) -> Path:
    """Put `mimpipe evaluate`'s table (markdown) into the export's card as its Evaluation section, replacing an
    earlier one; the file is replaced whole (never half-written). An export written before cards gets one.

    Raises:
        ValueError: `export_dir` is not an export (no config.json and mimpipe.json).
    """
    export_dir = Path(export_dir)
    content = "Measured on these weights by `mimpipe evaluate`:\n\n" + table_markdown.strip()
    return replace_card(export_dir, set_section(read_card(export_dir), EVALUATION, content))


def set_card_location(export_dir: str | Path, location: str) -> Path:
    """Point the card's "Use it in timm" at `location` (e.g. `hf-hub:ORG/NAME` before a push), replacing the file."""
    export_dir = Path(export_dir)
    return replace_card(export_dir, set_section(read_card(export_dir), USE, use_section(location)))


def read_card(export_dir: Path) -> str:
    """The export's card; for an export written before cards, one rendered from its config.json and manifest."""
    if (export_dir / CARD_NAME).is_file():
        return (export_dir / CARD_NAME).read_text()
    config, manifest = read_json(export_dir / "config.json"), read_json(export_dir / MANIFEST_NAME)
    if not config or not manifest:
        raise ValueError(f"{export_dir} is not a mimpipe export: no config.json and {MANIFEST_NAME}")
    files = sorted({p.name for p in export_dir.iterdir() if p.is_file()} | {CARD_NAME})
    return render_card(config, manifest, location=f"local-dir:{export_dir}", files=files)


def replace_card(export_dir: Path, text: str) -> Path:
    """Write the card beside itself and rename it into place (fsynced), so a reader sees the old or the new one."""
    path = export_dir / CARD_NAME
    tmp = export_dir / f".{CARD_NAME}.tmp-{secrets.token_hex(4)}"
    try:
        tmp.write_text(text)
        fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(export_dir)
    return path


def set_section(text: str, name: str, content: str) -> str:
    """The card with section `name` (a `## ` heading) holding `content`: replaced where it is, else inserted in its
    place in `ORDER` (headings inside code blocks do not count)."""
    front, preface, sections = split_card(text)
    if name in (heading for heading, _ in sections):
        sections = [(heading, content if heading == name else body) for heading, body in sections]
    else:
        rank = ORDER.index(name) if name in ORDER else len(ORDER)
        later = (i for i, (heading, _) in enumerate(sections) if heading in ORDER and ORDER.index(heading) > rank)
        at = next(later, len(sections))
        sections.insert(at, (name, content))
    parts = [preface.strip(), *(f"## {heading}\n\n{body.strip()}" for heading, body in sections)]
    return front + "\n\n".join(parts) + "\n"


def split_card(text: str) -> tuple[str, str, list[tuple[str, str]]]:
    """(front matter with its `---` lines and the blank line after, the text before the first section, [(heading,
    body)]) of a card."""
    front = ""
    if text.startswith("---\n") and "\n---\n" in text[4:]:
        end = text.index("\n---\n", 4) + len("\n---\n")
        front, text = text[:end] + "\n", text[end:]
    preface, sections, fenced = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if line.startswith("## ") and not fenced:
            sections.append((line[3:].strip(), []))
        elif sections:
            sections[-1][1].append(line)
        else:
            preface.append(line)
    return front, "\n".join(preface), [(heading, "\n".join(lines)) for heading, lines in sections]
