"""Machinery every kubeloop process shares: API client, informers, workqueue, events, leader
election, metrics and health, the CSI client connection and the process entry."""
