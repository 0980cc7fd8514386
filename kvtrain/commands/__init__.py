"""CLI subcommands (see kvtrain.cli)."""
