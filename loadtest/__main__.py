"""`python -m loadtest report|compare|crossover|plan|splits|soak ...`"""
import importlib
import sys

COMMANDS = ("report", "compare", "crossover", "plan", "splits", "soak")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m loadtest {{{','.join(COMMANDS)}}} [--help | options]", file=sys.stderr)
        return 2
    return importlib.import_module(f"loadtest.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
