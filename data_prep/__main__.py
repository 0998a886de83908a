"""`python -m data_prep prep-data ...` / `python -m data_prep data inspect DIR`: the data commands
without the rest of `tlf` (quick to start; used by the resume test that kills a real process)."""

import click

from data_prep.cli import data, prep_data


@click.group()
def main() -> None:
    """tlf's data commands."""


main.add_command(prep_data)
main.add_command(data)

if __name__ == "__main__":
    main()
