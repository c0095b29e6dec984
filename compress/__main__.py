from compress.cli import main

main()
