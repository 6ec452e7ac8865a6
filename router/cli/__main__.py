from router.cli import run

run()
