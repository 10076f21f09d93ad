"""`kiln serve --replicas N`: several engine replicas behind one OpenAI ingress, on Ray Serve (kiln[cluster]).

routing.py (the policies, pure Python) <- router.py (Ray Serve's request router API) ; replica.py (the engine
deployments) ; ingress.py (the AsyncLLM-shaped front the HTTP app of runtime/server/ runs on) ; launch.py.
"""
