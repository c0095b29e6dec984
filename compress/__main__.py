from compress.entry import main

main()
