"""Floor 6: tools above the library (cli, demo, toy model, bench).

Nothing in the library imports them."""
