"""Producers seen live and the weights they follow: the pure logic and its stored form."""
