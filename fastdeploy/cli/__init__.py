"""The `fastdeploy` command (also `python -m fastdeploy`): serve, chat, complete, bench, run-batch and
collect-env sub-commands. fastdeploy/cli/main.py builds the parser and dispatches; each sub-command lives in
its own module. Nothing else in the package imports this one: it is the top layer."""
