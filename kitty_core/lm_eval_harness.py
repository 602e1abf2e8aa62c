"""lm-eval's own command line with the `kitty` model registered: every flag is lm-eval's.

    python -m kitty_core.lm_eval_harness --model kitty \\
        --model_args pretrained=Qwen/Qwen3-8B,method=kitty-pro,dtype=bfloat16 --tasks gsm8k --batch_size 16

lm-eval 0.4.13's `lm_eval` command fills its model registry from its own package only, so a model
defined elsewhere is registered by importing its module first; this is that import, then lm-eval's
`cli_evaluate`. Bad model_args (an unknown method, a model that does not load) end with one line
naming the argument, as does a task lm-eval does not know, with exit status 2; so does a missing
lm-eval, with the command that installs it.
"""

from __future__ import annotations

import sys

from .cli import require


def main(argv=None) -> int:
    require("lm_eval", "lm-eval", "eval", "kitty_core.lm_eval_harness")
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    from . import lm_eval_model  # noqa: F401  (registers "kitty")

    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    setup_logging()
    cli = HarnessCLI()
    args = cli.parse_args()
    try:
        cli.execute(args)
    except lm_eval_model.KittyLMError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:  # lm-eval's own check of --tasks
        if not str(err).startswith("Tasks not found"):
            raise
        print(f"error: {err} -- see `lm_eval ls tasks`; the long-context suite's tasks need the folder "
              "`python -m kitty_core.lm_eval_tasks` writes, passed with --include_path", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
