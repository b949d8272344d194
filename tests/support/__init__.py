"""What tests share: the one way to wait (`waits`) and the helpers several test modules use, each in
a module named for what it holds. Test modules import from here, never from one another."""
