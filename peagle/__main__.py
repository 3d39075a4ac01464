from peagle.cli import main

main()
