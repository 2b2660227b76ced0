from maxctx.launch.cli import cli

cli()
