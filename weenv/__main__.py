from weenv.cli import main

main()
