"""`python -m gpufaas.cli`: the `gpufaas` command line."""

from gpufaas.cli import main

main()
