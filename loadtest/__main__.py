"""`python -m loadtest report|compare|soak ...`"""
import sys

COMMANDS = ("report", "compare", "soak")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m loadtest {{{','.join(COMMANDS)}}} [--help | options]", file=sys.stderr)
        return 2
    if argv[0] == "report":
        from loadtest.report import main as command
    elif argv[0] == "compare":
        from loadtest.compare import main as command
    else:
        from loadtest.soak import main as command
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
