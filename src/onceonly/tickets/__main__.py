"""``python -m onceonly.tickets``: the same as ``onceonly tickets``."""

from onceonly.tickets.cli import tickets

if __name__ == "__main__":
    tickets(prog_name="python -m onceonly.tickets")
