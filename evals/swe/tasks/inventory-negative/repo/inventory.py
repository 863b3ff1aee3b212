class Inventory:
    def __init__(self):
        self.stock = {}

    def add(self, name, qty):
        self.stock[name] = self.stock.get(name, 0) + qty

    def remove(self, name, qty):
        self.stock[name] = self.stock.get(name, 0) - qty
