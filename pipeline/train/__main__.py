"""`python -m pipeline.train CONFIG [OVERRIDES]`, also under `deepspeed --module pipeline.train ...`
(the launcher's `--local_rank=N` argument is accepted and dropped; LOCAL_RANK comes from the environment)."""

import sys


def main() -> None:
    from pipeline.train.cli import train
    from pipeline.cli import strip_local_rank

    train.main(args=strip_local_rank(sys.argv[1:]), prog_name="python -m pipeline.train")


if __name__ == "__main__":
    main()
