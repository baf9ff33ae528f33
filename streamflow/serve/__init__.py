"""Model serving: the model zoo (zoo.py) and its labelled evaluation set (evalset.py)."""
