"""FedAvg, FedProx and FedAdam on a non-IID split of scikit-learn's digits across 3 sites."""
