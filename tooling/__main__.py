from tooling.cli import main

main()
