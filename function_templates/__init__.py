"""Starting points for users' functions, copied by `gpufaas new NAME --template T` (data, not imported code)."""
