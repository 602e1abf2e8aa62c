"""Methods against FP16 on lm-eval tasks: one table of task x method, each score beside FP16's.

    python -m kitty_core.lm_eval --model demo --methods fp16,kivi-k2v2,kitty-pro \\
        --tasks niah_single,passkey --lengths 1024,2048 --samples 5 --out data/results/lm_eval_demo_cpu.json

A name in --tasks that is a kind of the long-context suite (`lm_eval_tasks.KINDS`, or `long` for
all of them) becomes one task per length, generated for the model's tokenizer; any other name is
an lm-eval task (gsm8k, a group, a tag ...) as lm-eval knows it. The model is loaded once; each
method runs lm-eval's `simple_evaluate` over the `kitty` model (`lm_eval_model.KittyLM`) with that
method, FP16 first.

The file (JSON): {"settings": {...the command's settings, lm_eval's version}, "results": [row, ...]},
one row per task, metric and method: task (lm-eval's name), kind and length (suite tasks; null
otherwise), metric (lm-eval's key, e.g. "recall" or "exact_match,strict-match"), method, score,
stderr, samples (scored), fp16 (FP16's score), diff (score - fp16), seconds (the method's whole lm-eval
run). `read_table` reads it back.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from pathlib import Path

from .cli import count, parser, require, writable, write_text
from .config import parse_method

DEFAULT_METHODS = "fp16,kivi-k2v2,kivi-k2v2-sink,kitty,kitty-pro"
COLUMNS = ("task", "kind", "length", "metric", "method", "score", "stderr", "samples", "fp16", "diff")


def expand_tasks(tasks, lengths) -> tuple[list[str], list[str], list[str]]:
    """(suite kinds, lm-eval task names of the suite at these lengths, other lm-eval names)."""
    from .lm_eval_tasks import KINDS, task_name

    kinds, other = [], []
    for t in tasks:
        if t == "long":
            kinds += [k for k in KINDS if k not in kinds]
        elif t in KINDS:
            kinds += [t] if t not in kinds else []
        elif t not in other:
            other.append(t)
    return kinds, [task_name(k, n) for n in lengths for k in kinds], other


def _suite_name(task: str):
    """(kind, length) of a suite task's name, or (None, None)."""
    from .lm_eval_tasks import KINDS

    found = re.fullmatch(rf"kitty_({'|'.join(KINDS)})_(\d+)", task)
    return (found.group(1), int(found.group(2))) if found else (None, None)


def rows_of(results: dict, method: str) -> list[dict]:
    """One row per task and metric of a `simple_evaluate` result."""
    rows = []
    for task, metrics in results["results"].items():
        kind, length = _suite_name(task)
        n = results.get("n-samples", {}).get(task, {}).get("effective")
        for key, value in metrics.items():
            if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
                continue
            name, _, filt = key.partition(",")
            stderr = metrics.get(f"{name}_stderr,{filt}")
            rows.append({"task": task, "kind": kind, "length": length,
                         "metric": name if filt == "none" else key, "method": method, "score": float(value),
                         "stderr": float(stderr) if isinstance(stderr, (int, float)) else None, "samples": n})
    return rows


def against_fp16(rows: list[dict]):
    """The rows as a DataFrame with FP16's score of the same task and metric, and the difference."""
    import pandas as pd

    df = pd.DataFrame(rows)
    df = df.reindex(columns=[c for c in COLUMNS if c not in ("fp16", "diff")] + [c for c in df if c not in COLUMNS])
    ref = df[df.method == "fp16"].set_index(["task", "metric"]).score
    df.insert(df.columns.get_loc("samples") + 1, "fp16", [ref.get((t, m)) for t, m in zip(df.task, df.metric)])
    df.insert(df.columns.get_loc("fp16") + 1, "diff", df.score - df.fp16)
    return df


def run(lm, methods, tasks, lengths=(1024, 2048, 4096, 8192), samples: int = 50, seed: int = 0,
        limit: int | None = None, engine: str | None = None, batch_size=1, score_chunk: int = 128,
        num_fewshot: int | None = None, apply_chat_template: bool = False, tasks_dir: Path | None = None,
        gen_kwargs: str | None = None, progress=None, done: list[dict] = (), save=None):
    """Every method (FP16 first) on every task; a DataFrame of `COLUMNS`. `lm` is a LoadedModel.

    `done` holds rows measured before (a resumed run): their methods are not run again. `save`, if
    given, is called with the DataFrame so far after each method, so that an interrupted run keeps
    every method it finished.
    """
    import lm_eval
    from lm_eval.tasks import TaskManager

    from .hf import model_shape
    from .lm_eval_model import KittyLM
    from .lm_eval_tasks import write_suite

    methods = [m for m in dict.fromkeys(["fp16", *methods])]
    for m in methods:
        parse_method(m)
    kinds, suite, other = expand_tasks(tasks, lengths)
    if not suite and not other:
        raise ValueError("no tasks: name suite kinds (niah_single, ..., passkey, or long) or lm-eval tasks")
    context = model_shape(lm.model.config)["context"]
    if suite and context and max(lengths) > context:
        raise ValueError(f"length {max(lengths)} exceeds the model's context of {context} tokens; choose "
                         f"lengths up to {context}")
    include = None
    if suite:
        include, _ = write_suite(lm.tokenizer, tasks_dir, kinds, lengths, samples, seed,
                                 progress=(lambda i, n, s: progress(i, n, f"writing {s}")) if progress else None)
    manager = TaskManager(include_path=str(include) if include else None, include_defaults=bool(other))
    unknown = [t for t in other if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"lm-eval knows no task {', '.join(map(repr, unknown))}: see `lm_eval ls tasks`, or name "
                         f"a kind of the long-context suite")
    rows = list(done)
    measured = {r["method"] for r in rows}
    for i, m in enumerate(methods):
        if m in measured:
            continue
        if progress:
            progress(i, len(methods), m)
        model = KittyLM(pretrained=lm, method=m, engine=engine, score_chunk=score_chunk, batch_size=batch_size,
                        max_length=context or None)
        t0 = time.perf_counter()
        out = lm_eval.simple_evaluate(model=model, tasks=suite + other, task_manager=manager, limit=limit,
                                      num_fewshot=num_fewshot, apply_chat_template=apply_chat_template,
                                      gen_kwargs=gen_kwargs, log_samples=False, random_seed=seed)
        seconds = time.perf_counter() - t0
        rows += [{**r, "seconds": seconds} for r in rows_of(out, m)]
        if save:
            save(_table(rows, kinds))
    return _table(rows, kinds)


def _table(rows: list[dict], kinds):
    from .lm_eval_tasks import MAX_GEN

    df = against_fp16(rows)
    df.attrs["max_gen_toks"] = {k: MAX_GEN[k] for k in kinds}
    return df


def summary(df):
    """Scores as task x method, each method's difference to FP16 beside it."""
    import pandas as pd

    df = df.copy()
    df["row"] = [t if m in ("recall", "exact_match") else f"{t} ({m})" for t, m in zip(df.task, df.metric)]
    order = list(dict.fromkeys(df.method))
    score = df.pivot_table(index="row", columns="method", values="score", sort=False)[order]
    diff = df[df.method != "fp16"].pivot_table(index="row", columns="method", values="diff", sort=False)
    return pd.concat([score, diff.add_suffix(" - fp16")], axis=1)


def read_table(path: Path):
    """(settings, rows as a DataFrame) of a file this command wrote; ValueError naming what is wrong."""
    import pandas as pd

    try:
        found = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{Path(path).name} cannot be read as JSON ({err})") from None
    from .results import check_version

    if isinstance(found, dict):
        check_version(found, Path(path).name)
    rows = found.get("results") if isinstance(found, dict) else None
    if not isinstance(rows, list) or not rows or not isinstance(found.get("settings"), dict):
        raise ValueError(f"{Path(path).name} is not an lm-eval table: it needs settings and a list of results")
    df = pd.DataFrame(rows)
    missing = [c for c in COLUMNS if c not in df]
    if missing:
        raise ValueError(f"{Path(path).name}: its results lack the columns {', '.join(missing)}")
    return found["settings"], df


def main(argv=None) -> int:
    p = parser("kitty_core.lm_eval", __doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="demo | hub id | local directory | file.gguf")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated; fp16 is always run (first)")
    p.add_argument("--tasks", default="long",
                   help="suite kinds (niah_single, niah_multikey, niah_multivalue, vt, cwe, passkey; long: all) "
                        "and/or lm-eval task names (gsm8k ...), comma-separated")
    p.add_argument("--lengths", default="1024,2048,4096,8192", help="suite lengths in tokens (prompt + generation)")
    p.add_argument("--samples", type=count(1), default=50, help="samples per suite task and length")
    p.add_argument("--limit", type=count(1), default=None, help="lm-eval's --limit: samples per task at most")
    p.add_argument("--seed", type=int, default=0, help="of the suite's samples and of lm-eval")
    p.add_argument("--num-fewshot", type=count(0), default=None, help="lm-eval's --num_fewshot")
    p.add_argument("--apply-chat-template", action="store_true", help="lm-eval's --apply_chat_template")
    p.add_argument("--gen-kwargs", default=None,
                   help="lm-eval's --gen_kwargs, over every task's own, e.g. max_gen_toks=12 (fewer tokens decoded)")
    p.add_argument("--batch-size", default="1", help="an integer, or auto")
    p.add_argument("--score-chunk", type=count(1), default=128, help="continuation tokens per forward in loglikelihood")
    p.add_argument("--engine", default=None, help="reference | triton | triton+key_dots=... (default: triton on a GPU)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--tasks-dir", type=Path, default=None, help="where the suite's files go (default: under KITTY_CACHE_DIR)")
    p.add_argument("--out", type=Path, default=Path("data/results/lm_eval.json"), help="the table (JSON)")
    p.add_argument("--resume", action="store_true",
                   help="keep the methods that --out already holds from a run of the same settings and run only "
                        "the others (the table is written after each method)")
    a = p.parse_args(argv)
    require("lm_eval", "lm-eval", "eval", "kitty_core.lm_eval")
    from .engines import make_engine
    from .models import ModelLoadError, load_model

    try:
        methods = [m.strip() for m in a.methods.split(",") if m.strip()]
        for m in methods:
            parse_method(m)
        if a.engine:
            make_engine(a.engine)
        lengths = sorted({_length(x) for x in a.lengths.split(",") if x.strip()})
        batch = a.batch_size if a.batch_size.startswith("auto") else int(a.batch_size)
        writable(a.out)
        started = time.time()
        settings = {"model": a.model, "methods": ["fp16", *[m for m in methods if m != "fp16"]], "tasks": a.tasks,
                    "lengths": lengths, "samples": a.samples, "limit": a.limit, "seed": a.seed,
                    "num_fewshot": a.num_fewshot, "apply_chat_template": a.apply_chat_template,
                    "gen_kwargs": a.gen_kwargs, "batch_size": a.batch_size, "score_chunk": a.score_chunk,
                    "engine": a.engine or "default"}
        done, earlier = _resumed(a.out, settings) if a.resume else ([], {})
        lm = load_model(a.model, device=a.device, dtype=a.dtype)
        logging.getLogger("lm_eval").setLevel(logging.WARNING)
        import lm_eval

        settings.update({"device": str(lm.device), "dtype": str(lm.dtype), "lm_eval": lm_eval.__version__})
        if done:
            _same_settings(a.out, earlier, settings, ("device", "dtype", "lm_eval"))
        earlier_minutes = float(earlier.get("minutes") or 0.0)

        def save(df):
            minutes = round(earlier_minutes + (time.time() - started) / 60, 1)
            _write(a.out, {**settings, "methods": list(dict.fromkeys(df.method)),  # those measured so far
                           "max_gen_toks": df.attrs.get("max_gen_toks", {}), "minutes": minutes}, df)

        df = run(lm, methods, [t.strip() for t in a.tasks.split(",") if t.strip()], lengths, a.samples, a.seed,
                 a.limit, a.engine, batch, a.score_chunk, a.num_fewshot, a.apply_chat_template, a.tasks_dir,
                 a.gen_kwargs, progress=lambda i, n, s: print(f"[{i + 1}/{n}] {s}", file=sys.stderr, flush=True),
                 done=done, save=save)
    except (ValueError, ModelLoadError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    save(df)
    print(summary(df).to_string(float_format=lambda x: f"{x:.3f}"))
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


# settings a resumed run shares with the file it continues (its methods may differ; the device, dtype and
# lm-eval's version are compared once the model is loaded)
_RESUME_KEYS = ("model", "tasks", "lengths", "samples", "limit", "seed", "num_fewshot", "apply_chat_template",
                "gen_kwargs", "score_chunk", "engine")


def _resumed(path: Path, settings: dict) -> tuple[list[dict], dict]:
    """(rows, settings) of the earlier run in `path` that this one continues; none if there is no file."""
    if not Path(path).exists():
        return [], {}
    found, df = read_table(path)
    _same_settings(path, found, settings, _RESUME_KEYS)
    return df.drop(columns=["fp16", "diff"]).to_dict(orient="records"), found


def _same_settings(path: Path, found: dict, settings: dict, keys) -> None:
    differ = [k for k in keys if found.get(k) != settings.get(k)]
    if differ:
        raise ValueError(f"--resume: {Path(path).name} was written with other settings "
                         f"({', '.join(f'{k} {found.get(k)!r}, now {settings.get(k)!r}' for k in differ)}); "
                         f"give another --out, or the same settings")


def _write(path: Path, settings: dict, df) -> None:
    from .results import stamp

    records = json.loads(df.to_json(orient="records"))
    write_text(path, json.dumps(stamp({"settings": settings, "results": records}), indent=1))


def _length(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 256:
        raise ValueError(f"--lengths takes token counts of at least 256, got {text!r}")
    return value


if __name__ == "__main__":
    sys.exit(main())
