"""kubeloop's version: what `--version` prints and the driver's GetPluginInfo answers.

The same as pyproject.toml's (a unit test holds the two together). A constant rather than
importlib.metadata's lookup, which costs a process 2.5 MiB of anonymous memory for the email,
zipfile and csv modules it imports (issue 49), and which answers nothing from a checkout that was
never installed."""

VERSION = "0.1.0"
