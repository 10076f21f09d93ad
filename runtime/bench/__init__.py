"""kiln.runtime.bench: `kiln bench`, offline (an in-process engine) and serving (over HTTP).

The policy core never imports this package.
"""
