"""regression: a task labrun does not ship, in labrun's project layout. Regression on
scikit-learn's diabetes data: the dataset (data.py), an MLP (model.py), a mean-squared-error
task (task.py) and its deploy hooks (deploy.py), which labrun imports by the `_target_`s of
conf/ and the task's `deploy`."""
