from jaxgpt.process import signals

signals.hold()  # before the imports below: a signal that comes while they run is kept (see signals.py)

from jaxgpt.cli.main import entry  # noqa: E402

raise SystemExit(entry())
