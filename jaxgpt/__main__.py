from jaxgpt.cli import entry

raise SystemExit(entry())
