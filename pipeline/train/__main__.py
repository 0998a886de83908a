"""`python -m pipeline.train CONFIG [OVERRIDES]`, also under `deepspeed --module pipeline.train ...`
(the launcher's `--local_rank=N` argument is accepted and dropped; LOCAL_RANK comes from the environment)."""
import os
import sys


def main() -> None:
    args, it = [], iter(sys.argv[1:])
    for a in it:
        if a.startswith("--local_rank="):
            os.environ.setdefault("LOCAL_RANK", a.split("=", 1)[1])
        elif a == "--local_rank":
            os.environ.setdefault("LOCAL_RANK", next(it, "0"))
        else:
            args.append(a)
    from pipeline.train.cli import train

    train.main(args=args, prog_name="python -m pipeline.train")


if __name__ == "__main__":
    main()
